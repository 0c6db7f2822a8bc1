/* A holder whose main thread has exited: it opens the files it is given, maps one device node and closes that
 * fd, listens on a TCP socket of 127.0.0.1, starts a thread, prints the port, and its main thread calls
 * pthread_exit(). The thread group lives on in that thread: /proc/PID/fd and /proc/PID/maps of the leader (a
 * zombie) read empty, /proc/PID/task/TID shows them. It ends when its stdin closes.
 *
 * usage: leaderless MAP_PATH|- [OPEN_PATH...]
 */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

static void *wait_for_stdin(void *unused) {
    char byte;
    (void)unused;
    while (read(0, &byte, 1) > 0) {
    }
    exit(0);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: leaderless MAP_PATH|- [OPEN_PATH...]\n");
        return 2;
    }
    if (argv[1][0] != '-') {
        int fd = open(argv[1], O_RDONLY);
        if (fd < 0 || mmap(NULL, 4096, PROT_READ, MAP_SHARED, fd, 0) == MAP_FAILED) {
            perror(argv[1]);
            return 1;
        }
        close(fd);
    }
    for (int i = 2; i < argc; i++) {
        if (open(argv[i], O_RDONLY) < 0) {
            perror(argv[i]);
            return 1;
        }
    }
    int server = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in address = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t size = sizeof(address);
    if (server < 0 || bind(server, (struct sockaddr *)&address, size) != 0 || listen(server, 1) != 0 ||
        getsockname(server, (struct sockaddr *)&address, &size) != 0) {
        perror("socket");
        return 1;
    }
    pthread_t thread;
    if (pthread_create(&thread, NULL, wait_for_stdin, NULL) != 0) {
        return 1;
    }
    printf("%d\n", ntohs(address.sin_port));
    fflush(stdout);
    pthread_exit(NULL);
}
