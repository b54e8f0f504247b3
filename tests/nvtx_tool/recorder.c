/* A minimal NVTX injection tool for tests: the part of what Nsight Systems does when it attaches
 * to a process. NVTX (in the `nvtx` Python package) loads it from NVTX_INJECTION64_PATH and calls
 * InitializeInjectionNvtx2; it fills the CORE2 callback slots (domains, registered strings,
 * categories, push/pop and start/end ranges) and appends one line per call to the file named by
 * LLM_OTEL_NVTX_RECORD:
 *   push <domain> <message> <category id> <payload type> <payload>
 *   pop <domain> | start <domain> <message> <category id> <payload type> <payload> <range id>
 *   end <range id> | category <domain> <id> <name>
 * Payload types (nvToolsExt.h, nvToolsExtPayload.h): NVTX_PAYLOAD_TYPE_INT64 = 2, printed as a
 * signed integer; NVTX_PAYLOAD_TYPE_EXT = (int32)0xDFBD0009 (a structured NumPy payload), printed
 * as the hex of its bytes. */
#define NVTX_NO_IMPL
#include <nvtx3/nvToolsExt.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>

struct nvtxDomainRegistration_st { char name[128]; };
struct nvtxStringRegistration_st { char text[256]; };

static FILE* out;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t next_range = 1;

/* mirrors nvtxPayloadData_t (nvToolsExtPayload.h) */
struct payload_data { uint64_t schemaId; size_t size; const void* payload; };
#define PAYLOAD_TYPE_EXT ((int32_t)0xDFBD0009)

static void payload(const nvtxEventAttributes_t* a) {
    if (a->payloadType == PAYLOAD_TYPE_EXT) {
        const struct payload_data* pd = (const struct payload_data*)(uintptr_t)a->payload.ullValue;
        const unsigned char* b = (const unsigned char*)pd->payload;
        for (size_t i = 0; i < pd->size && i < 256; i++) fprintf(out, "%02x", b[i]);
    } else {
        fprintf(out, "%lld", (long long)a->payload.llValue);
    }
}

static const char* dname(nvtxDomainHandle_t d) { return d ? d->name : "-"; }
static const char* msg(const nvtxEventAttributes_t* a) {
    if (a->messageType == NVTX_MESSAGE_TYPE_REGISTERED && a->message.registered)
        return a->message.registered->text;
    if (a->messageType == NVTX_MESSAGE_TYPE_ASCII && a->message.ascii) return a->message.ascii;
    return "-";
}

static nvtxDomainHandle_t domain_create(const char* name) {
    nvtxDomainHandle_t d = calloc(1, sizeof(*d));
    strncpy(d->name, name ? name : "", sizeof(d->name) - 1);
    return d;
}
static void domain_destroy(nvtxDomainHandle_t d) { (void)d; }
static nvtxStringHandle_t register_string(nvtxDomainHandle_t d, const char* s) {
    (void)d;
    nvtxStringHandle_t h = calloc(1, sizeof(*h));
    strncpy(h->text, s ? s : "", sizeof(h->text) - 1);
    return h;
}
static void name_category(nvtxDomainHandle_t d, uint32_t id, const char* name) {
    pthread_mutex_lock(&lock);
    fprintf(out, "category %s %u %s\n", dname(d), id, name); fflush(out);
    pthread_mutex_unlock(&lock);
}
static int push(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
    pthread_mutex_lock(&lock);
    fprintf(out, "push %s %s %u %d ", dname(d), msg(a), a->category, a->payloadType);
    payload(a);
    fprintf(out, "\n");
    fflush(out);
    pthread_mutex_unlock(&lock);
    return 0;
}
static int pop(nvtxDomainHandle_t d) {
    pthread_mutex_lock(&lock);
    fprintf(out, "pop %s\n", dname(d)); fflush(out);
    pthread_mutex_unlock(&lock);
    return 0;
}
static nvtxRangeId_t start(nvtxDomainHandle_t d, const nvtxEventAttributes_t* a) {
    pthread_mutex_lock(&lock);
    nvtxRangeId_t id = next_range++;
    fprintf(out, "start %s %s %u %d ", dname(d), msg(a), a->category, a->payloadType);
    payload(a);
    fprintf(out, " %llu\n", (unsigned long long)id);
    fflush(out);
    pthread_mutex_unlock(&lock);
    return id;
}
static void end(nvtxDomainHandle_t d, nvtxRangeId_t id) {
    (void)d;
    pthread_mutex_lock(&lock);
    fprintf(out, "end %llu\n", (unsigned long long)id); fflush(out);
    pthread_mutex_unlock(&lock);
}

int InitializeInjectionNvtx2(NvtxGetExportTableFunc_t getExportTable) {
    const char* path = getenv("LLM_OTEL_NVTX_RECORD");
    out = fopen(path ? path : "/dev/null", "a");
    if (!out) return 0;
    const NvtxExportTableCallbacks* cb = (const NvtxExportTableCallbacks*)getExportTable(NVTX_ETID_CALLBACKS);
    NvtxFunctionTable t = 0;
    unsigned int size = 0;
    if (!cb || !cb->GetModuleFunctionTable(NVTX_CB_MODULE_CORE2, &t, &size)) return 0;
#define SET(id, fn) if ((unsigned)(id) < size && t[id]) *t[id] = (NvtxFunctionPointer)(fn)
    SET(NVTX_CBID_CORE2_DomainCreateA, domain_create);
    SET(NVTX_CBID_CORE2_DomainDestroy, domain_destroy);
    SET(NVTX_CBID_CORE2_DomainRegisterStringA, register_string);
    SET(NVTX_CBID_CORE2_DomainNameCategoryA, name_category);
    SET(NVTX_CBID_CORE2_DomainRangePushEx, push);
    SET(NVTX_CBID_CORE2_DomainRangePop, pop);
    SET(NVTX_CBID_CORE2_DomainRangeStartEx, start);
    SET(NVTX_CBID_CORE2_DomainRangeEnd, end);
    return 1;
}
