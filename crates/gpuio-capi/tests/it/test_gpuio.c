/* Every function of gpuio's C API, and its error paths, from C: run by tests/it/main.rs with a
 * scratch directory as its argument. Prints what failed and exits 1, or "all C API checks
 * passed". On a CUDA machine it also borrows memory from the CUDA runtime it finds. */
#include "gpuio.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int failures;

#define CHECK(cond)                                                                      \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "%s:%d: check failed: %s (last error: %s)\n", __FILE__,      \
                    __LINE__, #cond, gpuio_last_error());                                \
            failures++;                                                                  \
        }                                                                                \
    } while (0)

#define EXPECT(call, code) CHECK((call) == (code))

static atomic_int callbacks;
static atomic_int callback_status = 1;
static atomic_size_t callback_bytes;

static void on_done(void *user_data, int status, size_t bytes) {
    CHECK(user_data == (void *)&callbacks);
    atomic_store(&callback_status, status);
    atomic_store(&callback_bytes, bytes);
    atomic_fetch_add(&callbacks, 1);
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)((i * 31 + seed * 7) ^ (i >> 9));
}

static void errors_and_names(void) {
    CHECK(strcmp(gpuio_error_name(GPUIO_SUCCESS), "GPUIO_SUCCESS") == 0);
    CHECK(strcmp(gpuio_error_name(GPUIO_ERROR_IO), "GPUIO_ERROR_IO") == 0);
    CHECK(strcmp(gpuio_error_name(GPUIO_ERROR_CANCELED), "GPUIO_ERROR_CANCELED") == 0);
    CHECK(strcmp(gpuio_error_name(-99), "GPUIO_ERROR_UNKNOWN") == 0);
    CHECK(gpuio_error_is_retryable(GPUIO_ERROR_BUSY) == 1);
    CHECK(gpuio_error_is_retryable(GPUIO_ERROR_INVALID_ARG) == 0);
    CHECK(gpuio_last_error() != NULL);
}

static gpuio_context_t *init_paths(const char *dir) {
    gpuio_context_t *ctx = NULL;
    gpuio_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    EXPECT(gpuio_init(&cfg, &ctx), GPUIO_ERROR_INVALID_ARG); /* api_version 0 */
    CHECK(strstr(gpuio_last_error(), "api_version") != NULL);
    cfg.api_version = GPUIO_API_VERSION;
    cfg.flags = 4;
    EXPECT(gpuio_init(&cfg, &ctx), GPUIO_ERROR_INVALID_ARG);
    cfg.flags = 0;
    char missing[4096];
    snprintf(missing, sizeof missing, "%s/missing.toml", dir);
    cfg.config_file = missing;
    CHECK(gpuio_init(&cfg, &ctx) < 0);
    cfg.config_file = NULL;
    EXPECT(gpuio_init(&cfg, NULL), GPUIO_ERROR_INVALID_ARG);
    cfg.max_gpus = -1;
    EXPECT(gpuio_init(&cfg, &ctx), GPUIO_ERROR_INVALID_ARG);
    cfg.max_gpus = 1;
    cfg.memory_pool_size = 256u << 20;
    cfg.log_level = "warn";
    EXPECT(gpuio_init(&cfg, &ctx), GPUIO_SUCCESS);
    CHECK(ctx != NULL);
    EXPECT(gpuio_finalize(ctx), GPUIO_SUCCESS);
    EXPECT(gpuio_finalize(NULL), GPUIO_SUCCESS);
    ctx = NULL;
    EXPECT(gpuio_init(NULL, &ctx), GPUIO_SUCCESS);
    return ctx;
}

static int devices(gpuio_context_t *ctx) {
    int n = 0;
    EXPECT(gpuio_get_device_count(ctx, &n), GPUIO_SUCCESS);
    CHECK(n >= 1);
    EXPECT(gpuio_get_device_count(NULL, &n), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_get_device_count(ctx, NULL), GPUIO_ERROR_INVALID_ARG);
    gpuio_device_info_t info;
    EXPECT(gpuio_get_device_info(ctx, 0, &info), GPUIO_SUCCESS);
    CHECK(info.device_id == 0 && info.total_memory > 0 && strlen(info.name) > 0);
    CHECK(info.is_cuda == 0 || info.compute_capability_major >= 5);
    EXPECT(gpuio_get_device_info(ctx, 99, &info), GPUIO_ERROR_NOT_FOUND);
    EXPECT(gpuio_get_device_info(ctx, -1, &info), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_get_device_info(ctx, 0, NULL), GPUIO_ERROR_INVALID_ARG);
    return info.is_cuda;
}

/* The AI tier's core calls: a KV pool stores entries from GPU memory and loads selections into
 * it; an Engram table's rows are looked up by id and stored back. `h` and `h2` are host
 * memory of at least 64 KiB each. */
static void ai_tier(gpuio_context_t *ctx, gpuio_mem_t *h, gpuio_mem_t *h2) {
    enum { ENTRY = 64, TOKENS = 256, SEL = 5 };
    gpuio_mem_t *src = NULL, *out = NULL;
    EXPECT(gpuio_mem_alloc_device(ctx, 0, ENTRY * TOKENS, &src), GPUIO_SUCCESS);
    EXPECT(gpuio_mem_alloc_device(ctx, 0, ENTRY * TOKENS, &out), GPUIO_SUCCESS);
    unsigned char *kv = gpuio_mem_host_ptr(h), *back = gpuio_mem_host_ptr(h2);
    fill(kv, ENTRY * TOKENS, 9);
    gpuio_end_t hs = {.mem = h}, ds = {.mem = src}, dout = {.mem = out}, hb = {.mem = h2};
    EXPECT(gpuio_transfer(ctx, hs, ds, ENTRY * TOKENS), GPUIO_SUCCESS);

    gpuio_kv_pool_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.layers = 2;
    cfg.entry_bytes = ENTRY;
    cfg.max_tokens = TOKENS;
    cfg.hot_slots = 16;
    cfg.max_selection = 8;
    cfg.numa = -1;
    gpuio_kv_pool_t *pool = NULL;
    EXPECT(gpuio_kv_pool_create(ctx, &cfg, &pool), GPUIO_SUCCESS);
    float scores[TOKENS];
    for (int i = 0; i < TOKENS; i++) scores[i] = (float)i;
    EXPECT(gpuio_kv_pool_store(ctx, pool, 1, 0, TOKENS, src, 0, scores), GPUIO_SUCCESS);
    uint64_t sel[SEL] = {200, 3, 3, 255, 0};
    gpuio_kv_load_report_t rep;
    memset(&rep, 0xff, sizeof rep);
    EXPECT(gpuio_kv_pool_load(pool, 1, sel, SEL, out, 0, &rep), GPUIO_SUCCESS);
    CHECK(rep.selected == SEL && rep.misses == 4 && rep.hits == 0);
    EXPECT(gpuio_transfer(ctx, dout, hb, SEL * ENTRY), GPUIO_SUCCESS);
    for (int i = 0; i < SEL; i++)
        CHECK(memcmp(back + i * ENTRY, kv + sel[i] * ENTRY, ENTRY) == 0);
    EXPECT(gpuio_kv_pool_load(pool, 1, sel, SEL, out, 0, &rep), GPUIO_SUCCESS);
    CHECK(rep.hits == SEL);
    EXPECT(gpuio_kv_pool_load(pool, 1, sel, SEL, out, 0, NULL), GPUIO_SUCCESS);
    sel[1] = TOKENS; /* never stored */
    EXPECT(gpuio_kv_pool_load(pool, 1, sel, SEL, out, 0, &rep), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_kv_pool_load(pool, 1, sel, SEL, h, 0, &rep), GPUIO_ERROR_INVALID_ARG);
    CHECK(strstr(gpuio_last_error(), "GPU memory") != NULL);
    EXPECT(gpuio_kv_pool_load(pool, 1, NULL, SEL, out, 0, &rep), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_kv_pool_store(ctx, pool, 0, 9, 1, src, 0, NULL), GPUIO_ERROR_INVALID_ARG);
    cfg.layers = 0;
    gpuio_kv_pool_t *none = NULL;
    EXPECT(gpuio_kv_pool_create(ctx, &cfg, &none), GPUIO_ERROR_INVALID_ARG);
    CHECK(none == NULL);
    EXPECT(gpuio_kv_pool_free(pool), GPUIO_SUCCESS);
    EXPECT(gpuio_kv_pool_free(NULL), GPUIO_SUCCESS);

    enum { ROWS = 100, ROW = 32 };
    gpuio_engram_table_t *t = NULL;
    EXPECT(gpuio_engram_table_create(ctx, ROWS, ROW, -1, &t), GPUIO_SUCCESS);
    gpuio_mem_t *rows = NULL;
    EXPECT(gpuio_engram_table_memory(t, &rows), GPUIO_SUCCESS);
    CHECK(gpuio_mem_len(rows) == ROWS * ROW);
    unsigned char *table = gpuio_mem_host_ptr(rows);
    fill(table, ROWS * ROW, 4);
    uint64_t ids[4] = {99, 0, 7, 7}, fetched = 0;
    EXPECT(gpuio_engram_lookup(ctx, t, ids, 4, out, 0, &fetched), GPUIO_SUCCESS);
    CHECK(fetched >= 3 && fetched <= 4);
    EXPECT(gpuio_transfer(ctx, dout, hb, 4 * ROW), GPUIO_SUCCESS);
    for (int i = 0; i < 4; i++) CHECK(memcmp(back + i * ROW, table + ids[i] * ROW, ROW) == 0);
    uint64_t to[2] = {5, 6};
    EXPECT(gpuio_engram_store(ctx, t, to, 2, src, 0), GPUIO_SUCCESS);
    CHECK(memcmp(table + 5 * ROW, kv, 2 * ROW) == 0);
    ids[0] = ROWS;
    EXPECT(gpuio_engram_lookup(ctx, t, ids, 4, out, 0, NULL), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_engram_table_free(t), GPUIO_SUCCESS);
    /* The memory outlives the table while a gpuio_mem_t of it is held. */
    CHECK(memcmp(table + 5 * ROW, kv, 2 * ROW) == 0);
    EXPECT(gpuio_mem_free(rows), GPUIO_SUCCESS);
    EXPECT(gpuio_mem_free(src), GPUIO_SUCCESS);
    EXPECT(gpuio_mem_free(out), GPUIO_SUCCESS);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SCRATCH_DIR\n", argv[0]);
        return 2;
    }
    enum { LEN = 4 << 20, PART = 1 << 20 };
    char path[4096];
    snprintf(path, sizeof path, "%s/c-api.bin", argv[1]);
    unsigned char *data = malloc(LEN), *back = malloc(LEN);
    fill(data, LEN, 3);

    errors_and_names();
    gpuio_context_t *ctx = init_paths(argv[1]);
    int cuda = devices(ctx);

    /* Files: written and read with the caller's host memory. */
    gpuio_handle_t *w = NULL, *r = NULL;
    EXPECT(gpuio_open(ctx, path, 7, &w), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_open(ctx, "gpu0", GPUIO_OPEN_READ, &w), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_open(ctx, NULL, GPUIO_OPEN_READ, &w), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_open(ctx, path, GPUIO_OPEN_READ, &r), GPUIO_ERROR_NOT_FOUND);
    EXPECT(gpuio_open(ctx, path, GPUIO_OPEN_WRITE, &w), GPUIO_SUCCESS);
    EXPECT(gpuio_write(ctx, w, 0, data, LEN), GPUIO_SUCCESS);
    EXPECT(gpuio_write(ctx, w, 0, NULL, 16), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_close(w), GPUIO_SUCCESS);
    EXPECT(gpuio_close(NULL), GPUIO_SUCCESS);
    EXPECT(gpuio_open(ctx, path, GPUIO_OPEN_READ, &r), GPUIO_SUCCESS);
    uint64_t size = 0;
    EXPECT(gpuio_handle_size(r, &size), GPUIO_SUCCESS);
    CHECK(size == LEN);
    EXPECT(gpuio_handle_size(NULL, &size), GPUIO_ERROR_INVALID_ARG);
    memset(back, 0, LEN);
    EXPECT(gpuio_read(ctx, r, PART, back, PART), GPUIO_SUCCESS);
    CHECK(memcmp(back, data + PART, PART) == 0);
    CHECK(gpuio_read(ctx, r, LEN - 10, back, PART) < 0); /* past the end */
    EXPECT(gpuio_read(ctx, r, 0, NULL, PART), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_read(ctx, NULL, 0, back, PART), GPUIO_ERROR_INVALID_ARG);

    /* Memory gpuio holds, and transfers between ends. */
    gpuio_mem_t *host = NULL, *host2 = NULL, *dev = NULL, *borrowed = NULL;
    EXPECT(gpuio_mem_alloc_host(ctx, LEN, 1, &host), GPUIO_SUCCESS);
    EXPECT(gpuio_mem_alloc_host(ctx, LEN, 0, &host2), GPUIO_SUCCESS);
    EXPECT(gpuio_mem_alloc_device(ctx, 0, LEN, &dev), GPUIO_SUCCESS);
    EXPECT(gpuio_mem_alloc_device(ctx, 42, LEN, &borrowed), GPUIO_ERROR_NOT_FOUND);
    EXPECT(gpuio_mem_alloc_host(ctx, LEN, 1, NULL), GPUIO_ERROR_INVALID_ARG);
    CHECK(gpuio_mem_host_ptr(host) != NULL && gpuio_mem_len(host) == LEN);
    CHECK(gpuio_mem_host_ptr(dev) == NULL && gpuio_mem_device_addr(dev) != 0);
    CHECK(gpuio_mem_device_addr(host) == 0 && gpuio_mem_len(dev) == LEN);
    CHECK(gpuio_mem_host_ptr(NULL) == NULL && gpuio_mem_len(NULL) == 0);
    int rc = gpuio_mem_register_device(ctx, 0, gpuio_mem_device_addr(dev) + 4096, PART, &borrowed);
    if (cuda) {
        EXPECT(rc, GPUIO_SUCCESS);
        CHECK(gpuio_mem_device_addr(borrowed) == gpuio_mem_device_addr(dev) + 4096);
        gpuio_mem_t *refused = NULL;
        EXPECT(gpuio_mem_register_device(ctx, 0, (uint64_t)(uintptr_t)back, 64, &refused),
               GPUIO_ERROR_INVALID_ARG); /* host memory is not device memory */
        CHECK(refused == NULL);
    } else {
        EXPECT(rc, GPUIO_ERROR_UNSUPPORTED);
    }

    gpuio_end_t file = {.handle = r}, h = {.mem = host}, h2 = {.mem = host2}, d = {.mem = dev};
    gpuio_end_t both = {.handle = r, .mem = host}, neither = {0};
    EXPECT(gpuio_transfer(ctx, file, h, LEN), GPUIO_SUCCESS);
    CHECK(memcmp(gpuio_mem_host_ptr(host), data, LEN) == 0);
    EXPECT(gpuio_transfer(ctx, h, d, LEN), GPUIO_SUCCESS);
    EXPECT(gpuio_transfer(ctx, d, h2, LEN), GPUIO_SUCCESS);
    CHECK(memcmp(gpuio_mem_host_ptr(host2), data, LEN) == 0);
    EXPECT(gpuio_transfer(ctx, both, h, 16), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_transfer(ctx, file, neither, 16), GPUIO_ERROR_INVALID_ARG);
    CHECK(strstr(gpuio_last_error(), "exactly one") != NULL);
    EXPECT(gpuio_transfer(ctx, h, d, LEN + 1), GPUIO_ERROR_INVALID_ARG);
    if (borrowed) {
        gpuio_end_t b = {.mem = borrowed};
        file.offset = 2 * PART;
        EXPECT(gpuio_transfer(ctx, file, b, PART), GPUIO_SUCCESS);
        d.offset = 4096;
        EXPECT(gpuio_transfer(ctx, d, h2, PART), GPUIO_SUCCESS);
        CHECK(memcmp(gpuio_mem_host_ptr(host2), data + 2 * PART, PART) == 0);
        d.offset = 0;
        file.offset = 0;
    }

    /* Asynchronous requests: callback, poll, wait, cancel, failure. */
    gpuio_request_t *req = NULL;
    memset(gpuio_mem_host_ptr(host2), 0, LEN);
    file.offset = PART;
    EXPECT(gpuio_submit(ctx, file, h2, PART, on_done, &callbacks, &req), GPUIO_SUCCESS);
    size_t moved = 0;
    EXPECT(gpuio_request_wait(req, &moved), GPUIO_SUCCESS);
    CHECK(moved == PART);
    int done = 0;
    EXPECT(gpuio_request_test(req, &done), GPUIO_SUCCESS);
    CHECK(done == 1);
    CHECK(atomic_load(&callbacks) == 1 && atomic_load(&callback_status) == GPUIO_SUCCESS);
    CHECK(atomic_load(&callback_bytes) == PART);
    CHECK(memcmp(gpuio_mem_host_ptr(host2), data + PART, PART) == 0);
    EXPECT(gpuio_request_cancel(req), GPUIO_ERROR_BUSY);
    EXPECT(gpuio_request_free(req), GPUIO_SUCCESS);

    file.offset = LEN - 10;
    EXPECT(gpuio_submit(ctx, file, h2, PART, on_done, &callbacks, &req), GPUIO_SUCCESS);
    rc = gpuio_request_wait(req, NULL);
    CHECK(rc < 0 && strlen(gpuio_last_error()) > 0);
    CHECK(atomic_load(&callbacks) == 2 && atomic_load(&callback_status) == rc);
    EXPECT(gpuio_request_free(req), GPUIO_SUCCESS);
    file.offset = 0;

    EXPECT(gpuio_submit(ctx, file, h2, PART, NULL, NULL, &req), GPUIO_SUCCESS);
    do {
        EXPECT(gpuio_request_test(req, &done), GPUIO_SUCCESS);
    } while (!done);
    EXPECT(gpuio_request_wait(req, &moved), GPUIO_SUCCESS);
    EXPECT(gpuio_request_free(req), GPUIO_SUCCESS);
    EXPECT(gpuio_submit(ctx, file, h2, PART, NULL, NULL, NULL), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_submit(ctx, neither, h2, PART, NULL, NULL, &req), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_request_test(NULL, &done), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_request_wait(NULL, &moved), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_request_cancel(NULL), GPUIO_ERROR_INVALID_ARG);
    EXPECT(gpuio_request_free(NULL), GPUIO_SUCCESS);

    /* A batch: four ranges of the file into host memory. */
    memset(gpuio_mem_host_ptr(host2), 0, LEN);
    gpuio_transfer_t batch[4];
    for (int i = 0; i < 4; i++) {
        batch[i].src = (gpuio_end_t){.handle = r, .offset = (uint64_t)i * PART};
        batch[i].dst = (gpuio_end_t){.mem = host2, .offset = (uint64_t)i * PART};
        batch[i].len = PART;
    }
    uint64_t total = 0;
    EXPECT(gpuio_batch_submit(ctx, batch, 4, &total), GPUIO_SUCCESS);
    CHECK(total == LEN);
    CHECK(memcmp(gpuio_mem_host_ptr(host2), data, LEN) == 0);
    EXPECT(gpuio_batch_submit(ctx, batch, 0, &total), GPUIO_SUCCESS);
    EXPECT(gpuio_batch_submit(ctx, NULL, 4, &total), GPUIO_ERROR_INVALID_ARG);
    batch[2].src.offset = LEN;
    CHECK(gpuio_batch_submit(ctx, batch, 4, NULL) < 0);
    batch[2].src.offset = 2 * PART;

    /* The scheduler's classes and deadlines. */
    gpuio_submit_options_t opts;
    memset(&opts, 0, sizeof opts);
    opts.priority = GPUIO_PRIORITY_INFERENCE_REALTIME;
    opts.deadline_ns = 1000000000;
    memset(gpuio_mem_host_ptr(host2), 0, LEN);
    EXPECT(gpuio_submit_ex(ctx, file, h2, PART, &opts, NULL, NULL, &req), GPUIO_SUCCESS);
    EXPECT(gpuio_request_wait(req, &moved), GPUIO_SUCCESS);
    CHECK(moved == PART && memcmp(gpuio_mem_host_ptr(host2), data, PART) == 0);
    EXPECT(gpuio_request_free(req), GPUIO_SUCCESS);
    EXPECT(gpuio_submit_ex(ctx, file, h2, PART, NULL, NULL, NULL, &req), GPUIO_SUCCESS);
    EXPECT(gpuio_request_wait(req, &moved), GPUIO_SUCCESS);
    EXPECT(gpuio_request_free(req), GPUIO_SUCCESS);
    opts.priority = GPUIO_PRIORITY_BACKGROUND;
    EXPECT(gpuio_batch_submit_ex(ctx, batch, 4, &opts, &total), GPUIO_SUCCESS);
    CHECK(total == LEN && memcmp(gpuio_mem_host_ptr(host2), data, LEN) == 0);
    opts.priority = 99;
    req = NULL;
    EXPECT(gpuio_submit_ex(ctx, file, h2, PART, &opts, NULL, NULL, &req), GPUIO_ERROR_INVALID_ARG);
    CHECK(req == NULL && strstr(gpuio_last_error(), "priority") != NULL);
    EXPECT(gpuio_batch_submit_ex(ctx, batch, 4, &opts, &total), GPUIO_ERROR_INVALID_ARG);
    opts.priority = GPUIO_PRIORITY_DEFAULT;
    opts.flags = 1;
    EXPECT(gpuio_submit_ex(ctx, file, h2, PART, &opts, NULL, NULL, &req), GPUIO_ERROR_INVALID_ARG);

    ai_tier(ctx, host, host2);

    EXPECT(gpuio_mem_free(borrowed), GPUIO_SUCCESS);
    EXPECT(gpuio_mem_free(host), GPUIO_SUCCESS);
    EXPECT(gpuio_mem_free(host2), GPUIO_SUCCESS);
    EXPECT(gpuio_mem_free(dev), GPUIO_SUCCESS);
    EXPECT(gpuio_mem_free(NULL), GPUIO_SUCCESS);
    EXPECT(gpuio_close(r), GPUIO_SUCCESS);
    EXPECT(gpuio_finalize(ctx), GPUIO_SUCCESS);
    free(data);
    free(back);
    remove(path);
    if (failures) {
        fprintf(stderr, "%d C API checks failed\n", failures);
        return 1;
    }
    printf("all C API checks passed (%s)\n", cuda ? "CUDA" : "host backend");
    return 0;
}
