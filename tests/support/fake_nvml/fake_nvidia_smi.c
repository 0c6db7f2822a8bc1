/*
 * A stand-in nvidia-smi for tests of a driver root (the GPU Operator's /run/nvidia/driver): built static, so it
 * runs chrooted into a directory that holds nothing else. It answers from /fake-smi/responses inside its root:
 *
 *   <exit status> <file under /fake-smi> <argument prefix...>
 *
 * The first line whose prefix starts the arguments (joined by single spaces) wins: the file goes to stdout and
 * the status is returned. Unknown arguments get nvidia-smi's usage error (status 2). Every call is appended to
 * /fake-smi/calls.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv) {
    char args[2048] = "";
    for (int i = 1; i < argc; i++) {
        if (i > 1) strncat(args, " ", sizeof args - strlen(args) - 1);
        strncat(args, argv[i], sizeof args - strlen(args) - 1);
    }
    FILE *calls = fopen("/fake-smi/calls", "a");
    if (calls) {
        fprintf(calls, "%s\n", args);
        fclose(calls);
    }
    FILE *table = fopen("/fake-smi/responses", "r");
    char line[2048];
    while (table && fgets(line, sizeof line, table)) {
        line[strcspn(line, "\r\n")] = 0;
        int status = 0, offset = 0;
        char file[256];
        if (sscanf(line, "%d %255s %n", &status, file, &offset) < 2) continue;
        const char *prefix = line + offset;
        if (strncmp(args, prefix, strlen(prefix)) != 0) continue;
        char path[512];
        snprintf(path, sizeof path, "/fake-smi/%s", file);
        FILE *out = fopen(path, "r");
        if (!out) return 9;
        char chunk[4096];
        size_t n;
        while ((n = fread(chunk, 1, sizeof chunk, out)) > 0) fwrite(chunk, 1, n, stdout);
        fclose(out);
        fclose(table);
        return status;
    }
    fprintf(stderr, "Invalid combination of input arguments: %s\n", args);
    return 2;
}
