/*
 * A stand-in libnvidia-ml.so.1 for tests: exactly the NVML entry points probes/gpu/nvml.py reaches through
 * nvidia-ml-py, with the C signatures and struct layouts of nvml.h, serving devices described in the text
 * file named by $FAKE_NVML_CONFIG (re-read at every nvmlInitWithFlags). One build serves every scenario.
 *
 * Config lines (`#` starts a comment):
 *   driver <version>            init_error <code>        (before the first `gpu` line)
 *   gpu                         starts a device (healthy defaults: 80 GiB, nothing used, no errors)
 *   name <text>  uuid <text>  bus <bus id>  minor <n>
 *   ecc_corrected_volatile|ecc_uncorrected_volatile|ecc_corrected_aggregate|ecc_uncorrected_aggregate <n>
 *   retired_sbe <n>  retired_dbe <n>  retired_pending <0|1>
 *   remap_correctable <n>  remap_uncorrectable <n>  remap_pending <0|1>  remap_failure <0|1>
 *   recovery_action <n>  recovery_return <nvml code for the field>
 *   clock_event_reasons <bitmask>  memory_total_mib <n>  memory_used_mib <n>  temperature <C>  power_mw <mW>
 *   compute_process <pid> <used MiB>   graphics_process <pid> <used MiB>
 *   mig_uuid <MIG-uuid>                (MIG mode on, one MIG device per line, up to 7)
 *   error <nvml function name> <code>  (that call returns the code; 3 = NOT_SUPPORTED, 15 = GPU_IS_LOST)
 *   handle_error <code>                (nvmlDeviceGetHandleByIndex_v2 fails for this device)
 *   nvlinks <n>                        links the GPU has (0, the default: NvLink calls are NOT_SUPPORTED; a link
 *                                      number >= n is INVALID_ARGUMENT, as nvml.h documents for an invalid link)
 *   nvlink_down <link>                 that link's state is NVML_FEATURE_DISABLED (repeatable)
 *   nvlink_counter <link> <counter> <value>  nvmlNvLinkErrorCounter_t: 0 replay, 1 recovery, 2 CRC flit, 3 CRC data
 *   fabric_state <0-3>                 the fabric probe's state (NVML_GPU_FABRIC_STATE_*); absent: fabric info calls
 *                                      are NOT_SUPPORTED (not Hopper+NVSwitch)
 *   fabric_status <nvml code>  fabric_health_mask <n>  fabric_clique <n>
 *   fabric_v_max <2|3>                 newest nvmlGpuFabricInfoV struct version this "driver" knows (default 3;
 *                                      a newer one is ARGUMENT_VERSION_MISMATCH)
 * $FAKE_NVML_LOG, when set, names a file each call appends its function name to.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0, NVML_ERROR_UNINITIALIZED = 1, NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3, NVML_ERROR_NOT_FOUND = 6, NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
};

#define MAX_GPUS 16
#define MAX_PROCS 16
#define MAX_ERRORS 32
#define MAX_MIG 7
#define MAX_LINKS 36 /* NVML_NVLINK_MAX_LINKS */
#define NVLINK_COUNTERS 5 /* NVML_NVLINK_ERROR_COUNT */

struct fake_process { unsigned int pid; unsigned long long used; };
struct fake_error { char call[80]; int code; };
struct fake_device {
    char name[96], uuid[96], bus[32];
    unsigned int minor;
    unsigned long long ecc[2][2]; /* [corrected, uncorrected][volatile, aggregate] */
    unsigned int retired[2], retired_pending;
    unsigned int remap_correctable, remap_uncorrectable, remap_pending, remap_failure;
    unsigned int recovery_action; int recovery_return;
    unsigned long long clock_event_reasons, memory_total, memory_used;
    unsigned int temperature, power_mw;
    struct fake_process procs[2][MAX_PROCS]; /* [compute, graphics] */
    int nprocs[2];
    struct fake_error errors[MAX_ERRORS];
    int nerrors;
    int handle_error;
    char mig_uuids[MAX_MIG][96];
    int nmig;
    unsigned int nvlinks;
    unsigned char nvlink_down[MAX_LINKS];
    unsigned long long nvlink_counters[MAX_LINKS][NVLINK_COUNTERS];
    int fabric_supported, fabric_status;
    unsigned int fabric_state, fabric_health_mask, fabric_clique, fabric_v_max;
};
typedef struct fake_device *nvmlDevice_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain, bus, device, pciDeviceId, pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;
typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;
typedef union {
    double dVal; unsigned int uiVal; unsigned long ulVal; unsigned long long ullVal;
    long long sllVal; int siVal; unsigned short usVal;
} nvmlValue_t;
typedef struct {
    unsigned int fieldId, scopeId;
    long long timestamp, latencyUsec;
    unsigned int valueType;
    nvmlReturn_t nvmlReturn;
    nvmlValue_t value;
} nvmlFieldValue_t;

/* nvml.h: nvmlGpuFabricState_t is an unsigned char; the _v2/_v3 structs start with their version. */
#define NVML_GPU_FABRIC_UUID_LEN 16
typedef unsigned char nvmlGpuFabricState_t;
typedef struct {
    unsigned char clusterUuid[NVML_GPU_FABRIC_UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    nvmlGpuFabricState_t state;
} nvmlGpuFabricInfo_t;
typedef struct {
    unsigned int version;
    unsigned char clusterUuid[NVML_GPU_FABRIC_UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    nvmlGpuFabricState_t state;
    unsigned int healthMask;
} nvmlGpuFabricInfo_v2_t;
typedef struct {
    unsigned int version;
    unsigned char clusterUuid[NVML_GPU_FABRIC_UUID_LEN];
    nvmlReturn_t status;
    unsigned int cliqueId;
    nvmlGpuFabricState_t state;
    unsigned int healthMask;
    unsigned char healthSummary;
} nvmlGpuFabricInfo_v3_t;
#define NVML_STRUCT_VERSION(data, ver) (unsigned int)(sizeof(nvml##data##_v##ver##_t) | (ver << 24U))

static struct fake_device devices[MAX_GPUS];
static struct fake_device mig_devices[MAX_GPUS][MAX_MIG]; /* what MIG device handles point at */
static int ndevices, init_error, initialized;
static char driver_version[80];

static void log_call(const char *name) {
    const char *path = getenv("FAKE_NVML_LOG");
    if (!path) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    fprintf(f, "%s\n", name);
    fclose(f);
}

static void set_defaults(struct fake_device *d, int index) {
    memset(d, 0, sizeof *d);
    snprintf(d->name, sizeof d->name, "NVIDIA H100 80GB HBM3");
    snprintf(d->uuid, sizeof d->uuid, "GPU-00000000-0000-0000-0000-%012d", index);
    snprintf(d->bus, sizeof d->bus, "00000000:%02X:00.0", 0x18 + index);
    d->minor = (unsigned int)index;
    d->memory_total = 81559ULL << 20;
    d->temperature = 35;
    d->power_mw = 70000;
    d->fabric_v_max = 3;
}

static void load_config(void) {
    ndevices = 0;
    init_error = 0;
    snprintf(driver_version, sizeof driver_version, "550.54.15");
    const char *path = getenv("FAKE_NVML_CONFIG");
    if (!path) return;
    FILE *f = fopen(path, "r");
    if (!f) return;
    char line[512];
    struct fake_device *d = NULL;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n#")] = 0;
        char key[64] = "";
        int offset = 0;
        if (sscanf(line, " %63s %n", key, &offset) < 1) continue;
        const char *rest = line + offset;
        unsigned long long n = strtoull(rest, NULL, 0);
        if (!strcmp(key, "driver")) { snprintf(driver_version, sizeof driver_version, "%s", rest); continue; }
        if (!strcmp(key, "init_error")) { init_error = (int)n; continue; }
        if (!strcmp(key, "gpu")) {
            if (ndevices == MAX_GPUS) break;
            d = &devices[ndevices];
            set_defaults(d, ndevices++);
            continue;
        }
        if (!d) continue;
        if (!strcmp(key, "name")) snprintf(d->name, sizeof d->name, "%s", rest);
        else if (!strcmp(key, "uuid")) snprintf(d->uuid, sizeof d->uuid, "%s", rest);
        else if (!strcmp(key, "bus")) snprintf(d->bus, sizeof d->bus, "%s", rest);
        else if (!strcmp(key, "minor")) d->minor = (unsigned int)n;
        else if (!strcmp(key, "ecc_corrected_volatile")) d->ecc[0][0] = n;
        else if (!strcmp(key, "ecc_corrected_aggregate")) d->ecc[0][1] = n;
        else if (!strcmp(key, "ecc_uncorrected_volatile")) d->ecc[1][0] = n;
        else if (!strcmp(key, "ecc_uncorrected_aggregate")) d->ecc[1][1] = n;
        else if (!strcmp(key, "retired_sbe")) d->retired[0] = (unsigned int)n;
        else if (!strcmp(key, "retired_dbe")) d->retired[1] = (unsigned int)n;
        else if (!strcmp(key, "retired_pending")) d->retired_pending = (unsigned int)n;
        else if (!strcmp(key, "remap_correctable")) d->remap_correctable = (unsigned int)n;
        else if (!strcmp(key, "remap_uncorrectable")) d->remap_uncorrectable = (unsigned int)n;
        else if (!strcmp(key, "remap_pending")) d->remap_pending = (unsigned int)n;
        else if (!strcmp(key, "remap_failure")) d->remap_failure = (unsigned int)n;
        else if (!strcmp(key, "recovery_action")) d->recovery_action = (unsigned int)n;
        else if (!strcmp(key, "recovery_return")) d->recovery_return = (int)n;
        else if (!strcmp(key, "clock_event_reasons")) d->clock_event_reasons = n;
        else if (!strcmp(key, "memory_total_mib")) d->memory_total = n << 20;
        else if (!strcmp(key, "memory_used_mib")) d->memory_used = n << 20;
        else if (!strcmp(key, "temperature")) d->temperature = (unsigned int)n;
        else if (!strcmp(key, "power_mw")) d->power_mw = (unsigned int)n;
        else if (!strcmp(key, "handle_error")) d->handle_error = (int)n;
        else if (!strcmp(key, "nvlinks")) d->nvlinks = n < MAX_LINKS ? (unsigned int)n : MAX_LINKS;
        else if (!strcmp(key, "nvlink_down") && n < MAX_LINKS) d->nvlink_down[n] = 1;
        else if (!strcmp(key, "nvlink_counter")) {
            unsigned int link = 0, counter = 0;
            unsigned long long value = 0;
            if (sscanf(rest, "%u %u %llu", &link, &counter, &value) == 3 && link < MAX_LINKS && counter < NVLINK_COUNTERS)
                d->nvlink_counters[link][counter] = value;
        } else if (!strcmp(key, "fabric_state")) { d->fabric_supported = 1; d->fabric_state = (unsigned int)n; }
        else if (!strcmp(key, "fabric_status")) d->fabric_status = (int)n;
        else if (!strcmp(key, "fabric_health_mask")) d->fabric_health_mask = (unsigned int)n;
        else if (!strcmp(key, "fabric_clique")) d->fabric_clique = (unsigned int)n;
        else if (!strcmp(key, "fabric_v_max")) d->fabric_v_max = (unsigned int)n;
        else if (!strcmp(key, "mig_uuid") && d->nmig < MAX_MIG)
            snprintf(d->mig_uuids[d->nmig++], sizeof d->mig_uuids[0], "%s", rest);
        else if (!strcmp(key, "compute_process") || !strcmp(key, "graphics_process")) {
            int kind = key[0] == 'g';
            unsigned int pid = 0;
            unsigned long long mib = 0;
            if (sscanf(rest, "%u %llu", &pid, &mib) == 2 && d->nprocs[kind] < MAX_PROCS) {
                d->procs[kind][d->nprocs[kind]].pid = pid;
                d->procs[kind][d->nprocs[kind]++].used = mib << 20;
            }
        } else if (!strcmp(key, "error") && d->nerrors < MAX_ERRORS) {
            struct fake_error *e = &d->errors[d->nerrors];
            if (sscanf(rest, "%79s %d", e->call, &e->code) == 2) d->nerrors++;
        }
    }
    fclose(f);
}

/* The injected return code of `call` on device d, or success. Also checks init and logs the call. */
static nvmlReturn_t enter(const char *call, nvmlDevice_t d) {
    log_call(call);
    if (!initialized) return NVML_ERROR_UNINITIALIZED;
    if (d) {
        for (int i = 0; i < d->nerrors; i++)
            if (!strcmp(d->errors[i].call, call) || !strcmp(d->errors[i].call, "*")) return d->errors[i].code;
    }
    return NVML_SUCCESS;
}

#define ENTER(d) do { nvmlReturn_t r_ = enter(__func__, d); if (r_) return r_; } while (0)

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    log_call(__func__);
    load_config();
    if (init_error) return init_error;
    initialized = 1;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void) {
    ENTER(NULL);
    initialized = 0;
    return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    static char text[64];
    snprintf(text, sizeof text, "fake NVML error %d", result);
    return text;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER(NULL);
    snprintf(version, length, "%s", driver_version);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    ENTER(NULL);
    *count = (unsigned int)ndevices;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    ENTER(NULL);
    if (index >= (unsigned int)ndevices) return NVML_ERROR_INVALID_ARGUMENT;
    if (devices[index].handle_error) return devices[index].handle_error;
    *device = &devices[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *name, unsigned int length) {
    ENTER(d);
    snprintf(name, length, "%s", d->name);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *uuid, unsigned int length) {
    ENTER(d);
    snprintf(uuid, length, "%s", d->uuid);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t d, unsigned int *minor) {
    ENTER(d);
    *minor = d->minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t d, nvmlPciInfo_t *pci) {
    ENTER(d);
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busId, sizeof pci->busId, "%s", d->bus);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%s", d->bus + 4);
    pci->pciDeviceId = 0x233010DE;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t d, int errorType, int counterType, unsigned long long *count) {
    ENTER(d);
    if (errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1) return NVML_ERROR_INVALID_ARGUMENT;
    *count = d->ecc[errorType][counterType];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t d, int cause, unsigned int *count, unsigned long long *addresses) {
    ENTER(d);
    if (cause < 0 || cause > 1) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned int pages = d->retired[cause];
    if (!addresses || *count < pages) {
        *count = pages;
        return pages ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    for (unsigned int i = 0; i < pages; i++) addresses[i] = 0x1000ULL * (i + 1) + (unsigned long long)cause;
    *count = pages;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t d, unsigned int *isPending) {
    ENTER(d);
    *isPending = d->retired_pending;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t d, unsigned int *corrRows, unsigned int *uncRows,
                                       unsigned int *isPending, unsigned int *failureOccurred) {
    ENTER(d);
    *corrRows = d->remap_correctable;
    *uncRows = d->remap_uncorrectable;
    *isPending = d->remap_pending;
    *failureOccurred = d->remap_failure;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetFieldValues(nvmlDevice_t d, int valuesCount, nvmlFieldValue_t *values) {
    ENTER(d);
    for (int i = 0; i < valuesCount; i++) {
        nvmlFieldValue_t *v = &values[i];
        v->timestamp = 0;
        v->latencyUsec = 0;
        if (v->fieldId == 230 /* NVML_FI_DEV_GET_GPU_RECOVERY_ACTION */) {
            v->nvmlReturn = d->recovery_return;
            v->valueType = 1; /* NVML_VALUE_TYPE_UNSIGNED_INT */
            v->value.uiVal = d->recovery_action;
        } else {
            v->nvmlReturn = NVML_ERROR_NOT_SUPPORTED;
        }
    }
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t d, unsigned long long *reasons) {
    ENTER(d);
    *reasons = d->clock_event_reasons;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *memory) {
    ENTER(d);
    memory->total = d->memory_total;
    memory->used = d->memory_used;
    memory->free = d->memory_total - d->memory_used;
    return NVML_SUCCESS;
}

static nvmlReturn_t processes(nvmlDevice_t d, int kind, unsigned int *count, nvmlProcessInfo_t *infos) {
    unsigned int n = (unsigned int)d->nprocs[kind];
    if (!infos || *count < n) {
        *count = n;
        return n ? NVML_ERROR_INSUFFICIENT_SIZE : NVML_SUCCESS;
    }
    for (unsigned int i = 0; i < n; i++) {
        infos[i].pid = d->procs[kind][i].pid;
        infos[i].usedGpuMemory = d->procs[kind][i].used;
        infos[i].gpuInstanceId = 0xFFFFFFFFu;
        infos[i].computeInstanceId = 0xFFFFFFFFu;
    }
    *count = n;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
    ENTER(d);
    return processes(d, 0, count, infos);
}

nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t d, unsigned int *count, nvmlProcessInfo_t *infos) {
    ENTER(d);
    return processes(d, 1, count, infos);
}

nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t d, int sensor, unsigned int *temp) {
    ENTER(d);
    if (sensor != 0) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = d->temperature;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t d, unsigned int *power) {
    ENTER(d);
    *power = d->power_mw;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceValidateInforom(nvmlDevice_t d) {
    ENTER(d);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *currentMode, unsigned int *pendingMode) {
    ENTER(d);
    *currentMode = *pendingMode = d->nmig > 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t d, unsigned int *count) {
    ENTER(d);
    *count = d->nmig > 0 ? MAX_MIG : 0;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t d, unsigned int index, nvmlDevice_t *migDevice) {
    ENTER(d);
    if (index >= MAX_MIG) return NVML_ERROR_INVALID_ARGUMENT;
    if (index >= (unsigned int)d->nmig) return NVML_ERROR_NOT_FOUND;
    struct fake_device *mig = &mig_devices[d - devices][index];
    memset(mig, 0, sizeof *mig);
    snprintf(mig->uuid, sizeof mig->uuid, "%s", d->mig_uuids[index]);
    *migDevice = mig;
    return NVML_SUCCESS;
}

/* nvml.h: NOT_SUPPORTED when the device has no NvLink, INVALID_ARGUMENT for a link it does not have. */
static nvmlReturn_t nvlink_check(nvmlDevice_t d, unsigned int link) {
    if (!d->nvlinks) return NVML_ERROR_NOT_SUPPORTED;
    if (link >= d->nvlinks) return NVML_ERROR_INVALID_ARGUMENT;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t d, unsigned int link, int *isActive) {
    ENTER(d);
    nvmlReturn_t r = nvlink_check(d, link);
    if (r) return r;
    *isActive = d->nvlink_down[link] ? 0 /* NVML_FEATURE_DISABLED */ : 1 /* NVML_FEATURE_ENABLED */;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t d, unsigned int link, int counter,
                                             unsigned long long *counterValue) {
    ENTER(d);
    nvmlReturn_t r = nvlink_check(d, link);
    if (r) return r;
    if (counter < 0 || counter >= NVLINK_COUNTERS) return NVML_ERROR_INVALID_ARGUMENT;
    *counterValue = d->nvlink_counters[link][counter];
    return NVML_SUCCESS;
}

static void fabric_common(nvmlDevice_t d, unsigned char *uuid, nvmlReturn_t *status, unsigned int *clique,
                          nvmlGpuFabricState_t *state) {
    memset(uuid, 0, NVML_GPU_FABRIC_UUID_LEN);
    uuid[0] = 0xfa;
    *status = d->fabric_status;
    *clique = d->fabric_clique;
    *state = (nvmlGpuFabricState_t)d->fabric_state;
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfo(nvmlDevice_t d, nvmlGpuFabricInfo_t *info) {
    ENTER(d);
    if (!d->fabric_supported) return NVML_ERROR_NOT_SUPPORTED;
    fabric_common(d, info->clusterUuid, &info->status, &info->cliqueId, &info->state);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetGpuFabricInfoV(nvmlDevice_t d, nvmlGpuFabricInfo_v3_t *info) {
    ENTER(d);
    unsigned int version = info->version;
    int v3 = version == NVML_STRUCT_VERSION(GpuFabricInfo, 3);
    if (!(v3 && d->fabric_v_max >= 3) && version != NVML_STRUCT_VERSION(GpuFabricInfo, 2))
        return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    if (!d->fabric_supported) return NVML_ERROR_NOT_SUPPORTED;
    /* v2 and v3 share their layout up to healthMask; v3 adds healthSummary after it */
    fabric_common(d, info->clusterUuid, &info->status, &info->cliqueId, &info->state);
    info->healthMask = d->fabric_health_mask;
    if (v3) info->healthSummary = d->fabric_status ? 2 /* UNHEALTHY */ : 1 /* HEALTHY */;
    return NVML_SUCCESS;
}
