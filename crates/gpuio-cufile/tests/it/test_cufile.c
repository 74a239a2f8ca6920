/* gpuio's libcufile.so.0 from C, compiled against NVIDIA's own cufile.h: every part of the
 * API with host memory (which needs no GPU), and its error paths. With a GPU (argv[2] ==
 * "cuda"), the same reads and writes also run into and out of device memory allocated through
 * the CUDA driver, which this program loads with dlopen so that it builds without a GPU. */
#define _GNU_SOURCE
#include <cufile.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static int failures;

#define CHECK(cond)                                                          \
    do {                                                                     \
        if (!(cond)) {                                                       \
            fprintf(stderr, "%s:%d: FAILED: %s\n", __FILE__, __LINE__, #cond); \
            failures++;                                                      \
        }                                                                    \
    } while (0)
#define OK(call) CHECK((call).err == CU_FILE_SUCCESS)
#define FAILS(call, code) CHECK((call).err == (code))

/* The layout the Rust side pins (src/abi.rs LAYOUT), as NVIDIA's header has it. */
static void print_layout(void) {
#define L(expr) printf("layout %s %zu\n", #expr, (size_t)(expr))
    L(sizeof(CUfileError_t));
    L(sizeof(CUfileDrvProps_t));
    L(offsetof(CUfileDrvProps_t, fflags));
    L(offsetof(CUfileDrvProps_t, max_batch_io_timeout_msecs));
    L(sizeof(CUfileDescr_t));
    L(offsetof(CUfileDescr_t, handle));
    L(offsetof(CUfileDescr_t, fs_ops));
    L(sizeof(CUfileIOParams_t));
    L(offsetof(CUfileIOParams_t, u.batch.size));
    L(offsetof(CUfileIOParams_t, fh));
    L(offsetof(CUfileIOParams_t, opcode));
    L(offsetof(CUfileIOParams_t, cookie));
    L(sizeof(CUfileIOEvents_t));
    L(offsetof(CUfileIOEvents_t, ret));
    L(sizeof(CUfileIOVec_t));
    L(sizeof(CUfileStatsLevel1_t));
    L(offsetof(CUfileStatsLevel1_t, batch_submit_ops));
    L(offsetof(CUfileStatsLevel1_t, readv_ops));
    L(sizeof(CUfileStatsLevel2_t));
    L(sizeof(CUfilePerGpuStats_t));
    L(offsetof(CUfilePerGpuStats_t, writes_bytes));
    L(sizeof(CUfileStatsLevel3_t));
    L(offsetof(CUfileStatsLevel3_t, per_gpu_stats));
#undef L
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
    for (size_t i = 0; i < n; i++) p[i] = (unsigned char)((i * 131u + seed * 7u) ^ (i >> 9));
}

static CUfileError_t reg(CUfileHandle_t *fh, int fd) {
    CUfileDescr_t d;
    memset(&d, 0, sizeof d);
    d.type = CU_FILE_HANDLE_TYPE_OPAQUE_FD;
    d.handle.fd = fd;
    return cuFileHandleRegister(fh, &d);
}

/* Device memory through the CUDA driver, loaded at run time. */
typedef struct {
    CUresult (*init)(unsigned);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*retain)(CUcontext *, CUdevice);
    CUresult (*set_current)(CUcontext);
    CUresult (*alloc)(CUdeviceptr *, size_t);
    CUresult (*free_)(CUdeviceptr);
    CUresult (*htod)(CUdeviceptr, const void *, size_t);
    CUresult (*dtoh)(void *, CUdeviceptr, size_t);
} Cuda;

static int load_cuda(Cuda *c) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) return 0;
    *(void **)&c->init = dlsym(lib, "cuInit");
    *(void **)&c->device_get = dlsym(lib, "cuDeviceGet");
    *(void **)&c->retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
    *(void **)&c->set_current = dlsym(lib, "cuCtxSetCurrent");
    *(void **)&c->alloc = dlsym(lib, "cuMemAlloc_v2");
    *(void **)&c->free_ = dlsym(lib, "cuMemFree_v2");
    *(void **)&c->htod = dlsym(lib, "cuMemcpyHtoD_v2");
    *(void **)&c->dtoh = dlsym(lib, "cuMemcpyDtoH_v2");
    CUdevice dev;
    CUcontext ctx;
    return c->init && c->init(0) == CUDA_SUCCESS && c->device_get(&dev, 0) == CUDA_SUCCESS &&
           c->retain(&ctx, dev) == CUDA_SUCCESS && c->set_current(ctx) == CUDA_SUCCESS;
}

/* File <-> device memory: sync, with offsets, vectored, batch and stream calls. */
static void device_checks(Cuda *c, CUfileHandle_t fh, const unsigned char *want, size_t n) {
    CUdeviceptr dev;
    CHECK(c->alloc(&dev, n + 4096) == CUDA_SUCCESS);
    void *d = (void *)(uintptr_t)dev;
    static unsigned char back[1 << 21];
    CHECK(cuFileRead(fh, d, n, 0, 4096) == (ssize_t)n);
    CHECK(c->dtoh(back, dev + 4096, n) == CUDA_SUCCESS);
    CHECK(memcmp(back, want, n) == 0);
    /* registered, then a write from device memory and a read of it back */
    OK(cuFileBufRegister(d, n + 4096, 0));
    FAILS(cuFileBufRegister(d, n + 4096, 0), CU_FILE_MEMORY_ALREADY_REGISTERED);
    CHECK(cuFileWrite(fh, d, 65536, 1 << 22, 4096) == 65536);
    CHECK(cuFileRead(fh, d, 65536, 1 << 22, 0) == 65536);
    CHECK(c->dtoh(back, dev, 65536) == CUDA_SUCCESS);
    CHECK(memcmp(back, want, 65536) == 0);
    CHECK(cuFileRead(fh, d, n + 1, 0, 4096) == -CU_FILE_INVALID_MAPPING_RANGE);
    OK(cuFileBufDeregister(d));
    /* past the allocation */
    CHECK(cuFileRead(fh, d, n + 8192, 0, 0) < 0);
    /* stream and batch into device memory */
    size_t size = 8192;
    off_t foff = 8192, boff = 0;
    ssize_t done = -1;
    OK(cuFileReadAsync(fh, d, &size, &foff, &boff, &done, NULL));
    CHECK(done == 8192);
    CHECK(c->dtoh(back, dev, 8192) == CUDA_SUCCESS);
    CHECK(memcmp(back, want + 8192, 8192) == 0);
    CUfileBatchHandle_t b;
    OK(cuFileBatchIOSetUp(&b, 4));
    CUfileIOParams_t p[4];
    for (int i = 0; i < 4; i++) {
        memset(&p[i], 0, sizeof p[i]);
        p[i].mode = CUFILE_BATCH;
        p[i].fh = fh;
        p[i].opcode = CUFILE_READ;
        p[i].cookie = (void *)(uintptr_t)(i + 1);
        p[i].u.batch.devPtr_base = d;
        p[i].u.batch.devPtr_offset = i * 4096;
        p[i].u.batch.file_offset = (3 - i) * 4096;
        p[i].u.batch.size = 4096;
    }
    OK(cuFileBatchIOSubmit(b, 4, p, 0));
    CUfileIOEvents_t ev[4];
    unsigned nr = 4;
    OK(cuFileBatchIOGetStatus(b, 4, &nr, ev, NULL));
    CHECK(nr == 4);
    for (unsigned i = 0; i < nr; i++) CHECK(ev[i].status == CUFILE_COMPLETE && ev[i].ret == 4096);
    cuFileBatchIODestroy(b);
    CHECK(c->dtoh(back, dev, 16384) == CUDA_SUCCESS);
    for (int i = 0; i < 4; i++) CHECK(memcmp(back + i * 4096, want + (3 - i) * 4096, 4096) == 0);
    CHECK(c->free_(dev) == CUDA_SUCCESS);
    printf("device memory checks ran\n");
}

/* Pages of the first `len` bytes of `fd` the page cache holds (mincore of a mapping). */
static long cached_pages(int fd, size_t len) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE), pages = (len + page - 1) / page;
    static unsigned char vec[1 << 12];
    if (pages > sizeof vec) return -1;
    void *m = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) return -1;
    long n = -1;
    if (mincore(m, len, vec) == 0) {
        n = 0;
        for (size_t i = 0; i < pages; i++) n += vec[i] & 1;
    }
    munmap(m, len);
    return n;
}

/* Whether the kernel says what a file has cached (cachestat, Linux 6.5+), which the library
 * asks before it bypasses the cache. */
static int kernel_has_cachestat(int fd) {
    struct { uint64_t off, len; } range = {0, 4096};
    uint64_t stat[5];
    return syscall(451, fd, &range, stat, 0) == 0;
}

/* Reads `len` bytes at `at` through the O_DIRECT handle into host memory, or with `cu` into
 * device memory, as `got`; the bytes read. */
static ssize_t read_cold(CUfileHandle_t fh, Cuda *cu, unsigned char *got, size_t len, off_t at) {
    if (!cu) return cuFileRead(fh, got, len, at, 0);
    CUdeviceptr dev;
    if (cu->alloc(&dev, len + 8) != CUDA_SUCCESS) {
        CHECK(!"device allocation");
        return -1;
    }
    ssize_t n = cuFileRead(fh, (void *)(uintptr_t)dev, len, at, 8);
    if (n > 0) CHECK(cu->dtoh(got, dev + 8, (size_t)n) == CUDA_SUCCESS);
    CHECK(cu->free_(dev) == CUDA_SUCCESS);
    return n;
}

/* O_DIRECT descriptors: a range the page cache holds little of is read past it, and stays out
 * of it; a dirty cached page inside that range is still read as written (the kernel writes it
 * back first); the file's unaligned end and an unaligned range inside it read right. Into host
 * memory, and with a GPU into device memory. Prints why where it cannot check. */
static void cold_direct_checks(const char *dir, Cuda *cu) {
    enum { C = 1 << 20, TAIL = 777 };
    char cold_path[4096];
    snprintf(cold_path, sizeof cold_path, "%s/cold.bin", dir);
    static unsigned char want[C + TAIL], got[C + TAIL + 4096];
    int wfd = open(cold_path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(wfd >= 0);
    fill(want, C + TAIL, 5);
    CHECK(pwrite(wfd, want, C + TAIL, 0) == C + TAIL);
    CHECK(fsync(wfd) == 0);
    CHECK(posix_fadvise(wfd, 0, 0, POSIX_FADV_DONTNEED) == 0);
    const char *skip = NULL;
    long cached = cached_pages(wfd, C);
    if (!kernel_has_cachestat(wfd))
        skip = "the kernel cannot say what is cached (cachestat, Linux 6.5+)";
    else if (cached < 0)
        skip = "the scratch file cannot be mapped to see what is cached";
    else if (cached != 0)
        skip = "the scratch file system keeps clean pages cached (tmpfs?)";
    int dfd = skip ? -1 : open(cold_path, O_RDONLY | O_DIRECT);
    if (!skip && dfd < 0) skip = "the scratch file system refuses O_DIRECT";
    if (skip) {
        printf("cold O_DIRECT checks skipped: %s\n", skip);
        close(wfd);
        unlink(cold_path);
        return;
    }
    CUfileHandle_t dfh = NULL;
    OK(reg(&dfh, dfd));
    if (!dfh) {
        close(dfd);
        close(wfd);
        unlink(cold_path);
        return;
    }
    for (int round = 0; round < (cu ? 2 : 1); round++) {
        Cuda *dev = round ? cu : NULL;
        CHECK(posix_fadvise(wfd, 0, 0, POSIX_FADV_DONTNEED) == 0);
        fill(want + 8192, 4096, 6 + round);
        CHECK(pwrite(wfd, want + 8192, 4096, 8192) == 4096); /* dirty and cached */
        memset(got, 0, sizeof got);
        /* the whole file and more: a short read at its unaligned end */
        CHECK(read_cold(dfh, dev, got, C + TAIL + 100, 0) == C + TAIL);
        CHECK(memcmp(got, want, C + TAIL) == 0);
        long after = cached_pages(wfd, C);
        if (after != 1) fprintf(stderr, "round %d: %ld pages cached after the read\n", round, after);
        CHECK(after == 1); /* only the page written through the cache */
        /* cold again: an unaligned range inside, and the unaligned tail alone */
        CHECK(fsync(wfd) == 0);
        CHECK(posix_fadvise(wfd, 0, 0, POSIX_FADV_DONTNEED) == 0);
        CHECK(read_cold(dfh, dev, got, 5000, 12345) == 5000);
        CHECK(memcmp(got, want + 12345, 5000) == 0);
        CHECK(read_cold(dfh, dev, got, 4096, C + 5) == TAIL - 5);
        CHECK(memcmp(got, want + C + 5, TAIL - 5) == 0);
        /* warm now: served from the page cache, the same bytes */
        CHECK(pread(wfd, got, C + TAIL, 0) == C + TAIL);
        memset(got, 0, sizeof got);
        CHECK(read_cold(dfh, dev, got, C + TAIL, 0) == C + TAIL);
        CHECK(memcmp(got, want, C + TAIL) == 0);
        CHECK(fsync(wfd) == 0);
    }
    cuFileHandleDeregister(dfh);
    close(dfd);
    close(wfd);
    unlink(cold_path);
    printf("cold O_DIRECT checks ran\n");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s SCRATCH_DIR [cuda]\n", argv[0]);
        return 2;
    }
    print_layout();
    char path[4096], ro_path[4096], topo[4096];
    snprintf(path, sizeof path, "%s/data.bin", argv[1]);
    snprintf(ro_path, sizeof ro_path, "%s/ro.bin", argv[1]);
    snprintf(topo, sizeof topo, "%s/topology.json", argv[1]);

    int version = 0;
    OK(cuFileGetVersion(&version));
    CHECK(version == 1200);
    FAILS(cuFileGetVersion(NULL), CU_FILE_INVALID_VALUE);

    /* parameters: set before the driver opens, refused after */
    size_t v = 0, lo = 1, hi = 0;
    OK(cuFileSetParameterSizeT(CUFILE_PARAM_PROPERTIES_IO_BATCHSIZE, 64));
    OK(cuFileGetParameterSizeT(CUFILE_PARAM_PROPERTIES_IO_BATCHSIZE, &v));
    CHECK(v == 64);
    OK(cuFileGetParameterMinMaxValue(CUFILE_PARAM_PROPERTIES_IO_BATCHSIZE, &lo, &hi));
    CHECK(lo <= 64 && 64 <= hi);
    FAILS(cuFileSetParameterSizeT(CUFILE_PARAM_PROPERTIES_IO_BATCHSIZE, hi + 1),
          CU_FILE_DRIVER_UNSUPPORTED_LIMIT);
    FAILS(cuFileGetParameterSizeT((CUFileSizeTConfigParameter_t)999, &v), CU_FILE_INVALID_VALUE);
    bool flag = true;
    OK(cuFileSetParameterBool(CUFILE_PARAM_PREFER_IO_URING, true));
    OK(cuFileGetParameterBool(CUFILE_PARAM_PREFER_IO_URING, &flag));
    CHECK(flag);
    char level[16];
    OK(cuFileSetParameterString(CUFILE_PARAM_LOGGING_LEVEL, "INFO"));
    OK(cuFileGetParameterString(CUFILE_PARAM_LOGGING_LEVEL, level, sizeof level));
    CHECK(strcmp(level, "INFO") == 0);
    FAILS(cuFileGetParameterString(CUFILE_PARAM_LOGGING_LEVEL, level, 4), CU_FILE_INVALID_VALUE);
    FAILS(cuFileSetParameterString(CUFILE_PARAM_LOGGING_LEVEL, NULL), CU_FILE_INVALID_VALUE);
    size_t sizes[2] = {4, 1024}, counts[2] = {32, 8}, got_s[8], got_c[8];
    OK(cuFileSetParameterPosixPoolSlabArray(sizes, counts, 2));
    OK(cuFileGetParameterPosixPoolSlabArray(got_s, got_c, 8));
    CHECK(got_s[1] == 1024 && got_c[1] == 8);
    FAILS(cuFileGetParameterPosixPoolSlabArray(got_s, got_c, 1), CU_FILE_INVALID_VALUE);
    FAILS(cuFileSetParameterGpuBounceBufferSlabArray(sizes, NULL, 2), CU_FILE_INVALID_VALUE);
    OK(cuFileGetParameterGpuBounceBufferSlabArray(got_s, got_c, 8));

    OK(cuFileDriverOpen());
    CHECK(cuFileUseCount() == 1);
    FAILS(cuFileSetParameterSizeT(CUFILE_PARAM_PROPERTIES_IO_BATCHSIZE, 32), CU_FILE_DRIVER_ALREADY_OPEN);
    CUfileDrvProps_t props;
    OK(cuFileDriverGetProperties(&props));
    CHECK(props.nvfs.major_version == 0);
    CHECK(props.fflags & (1 << CU_FILE_BATCH_IO_SUPPORTED));
    CHECK(props.max_batch_io_size == 64);
    FAILS(cuFileDriverGetProperties(NULL), CU_FILE_INVALID_VALUE);
    OK(cuFileDriverSetMaxDirectIOSize(8192));
    OK(cuFileDriverSetPollMode(true, 8));
    OK(cuFileDriverSetMaxCacheSize(65536));
    OK(cuFileDriverSetMaxPinnedMemSize(1 << 20));
    OK(cuFileDriverGetProperties(&props));
    CHECK(props.nvfs.max_direct_io_size == 8192 && props.nvfs.poll_thresh_size == 8);
    CUfileP2PFlags_t p2p = (CUfileP2PFlags_t)7;
    OK(cuFileDriverGetP2PFlags(CU_FILE_NVME_SUPPORTED, &p2p));
    CHECK(p2p == 0);
    FAILS(cuFileDriverSetP2PFlags(CU_FILE_NVME_SUPPORTED, CU_FILE_P2P_FLAG_PCI_P2PDMA),
          CU_FILE_PLATFORM_NOT_SUPPORTED);
    FAILS(cuFileDriverGetP2PFlags((CUfileDriverStatusFlags_t)99, &p2p), CU_FILE_INVALID_VALUE);
    size_t bar = 0;
    CHECK(cuFileGetBARSizeInKB(-1, &bar).err == CU_FILE_DEVICE_NOT_FOUND);
    FAILS(cuFileGetBARSizeInKB(0, NULL), CU_FILE_INVALID_VALUE);
    OK(cuFileExportPCIeTopology(topo));
    CHECK(access(topo, R_OK) == 0);

    /* handles */
    CUfileHandle_t fh = NULL, other = NULL;
    FAILS(cuFileHandleRegister(&fh, NULL), CU_FILE_INVALID_VALUE);
    FAILS(reg(&fh, -1), CU_FILE_INVALID_VALUE);
    int pipefd[2];
    CHECK(pipe(pipefd) == 0);
    FAILS(reg(&fh, pipefd[0]), CU_FILE_INVALID_FILE_TYPE);
    close(pipefd[0]);
    close(pipefd[1]);
    FAILS(reg(&fh, pipefd[0]), CU_FILE_INVALID_VALUE); /* closed */
    int dirfd = open(argv[1], O_RDONLY | O_DIRECTORY);
    FAILS(reg(&fh, dirfd), CU_FILE_INVALID_FILE_TYPE);
    close(dirfd);
    CUfileDescr_t user_fs;
    memset(&user_fs, 0, sizeof user_fs);
    user_fs.type = CU_FILE_HANDLE_TYPE_USERSPACE_FS;
    FAILS(cuFileHandleRegister(&fh, &user_fs), CU_FILE_IO_NOT_SUPPORTED);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(fd >= 0);
    OK(reg(&fh, fd));
    CHECK(fh != NULL);
    FAILS(reg(&other, fd), CU_FILE_HANDLE_ALREADY_REGISTERED);

    /* sync IO with host memory, offsets, and the end of the file */
    enum { N = (1 << 20) + 123 };
    static unsigned char src[N], dst[N + 64];
    fill(src, N, 1);
    CHECK(cuFileWrite(fh, src, N, 0, 0) == N);
    CHECK(cuFileRead(fh, dst, N, 0, 64) == N);
    CHECK(memcmp(dst + 64, src, N) == 0);
    CHECK(cuFileRead(fh, dst, 1000, N - 10, 0) == 10);
    CHECK(memcmp(dst, src + N - 10, 10) == 0);
    CHECK(cuFileRead(fh, dst, 1000, N + 5, 0) == 0);
    CHECK(cuFileRead(fh, dst, 10, -1, 0) == -CU_FILE_INVALID_VALUE);
    CHECK(cuFileRead(fh, dst, 10, 0, -1) == -CU_FILE_INVALID_VALUE);
    CHECK(cuFileRead(fh, NULL, 10, 0, 0) == -CU_FILE_INVALID_VALUE);
    CHECK(cuFileRead((CUfileHandle_t)(uintptr_t)0xdead, dst, 10, 0, 0) == -CU_FILE_HANDLE_NOT_REGISTERED);
    CHECK(cuFileRead(NULL, dst, 10, 0, 0) == -CU_FILE_HANDLE_NOT_REGISTERED);
    CHECK(cuFileRead(fh, dst, 0, 0, 0) == 0);

    /* the program's descriptor may close: the library holds its own */
    int ro = open(ro_path, O_RDWR | O_CREAT | O_TRUNC, 0644);
    CHECK(write(ro, src, 4096) == 4096);
    close(ro);
    ro = open(ro_path, O_RDONLY);
    CUfileHandle_t rofh;
    OK(reg(&rofh, ro));
    close(ro);
    CHECK(cuFileWrite(rofh, src, 16, 0, 0) == -CU_FILE_PERMISSION_DENIED);
    CHECK(cuFileRead(rofh, dst, 4096, 0, 0) == 4096);
    CHECK(memcmp(dst, src, 4096) == 0);
    cuFileHandleDeregister(rofh);
    CHECK(cuFileRead(rofh, dst, 16, 0, 0) == -CU_FILE_HANDLE_NOT_REGISTERED);
    cuFileHandleDeregister(rofh);
    cuFileHandleDeregister(NULL);

    /* O_DIRECT descriptors: unaligned IO still works (served through the page cache) */
    int dfd = open(path, O_RDONLY | O_DIRECT);
    if (dfd >= 0) {
        CUfileHandle_t dfh;
        OK(reg(&dfh, dfd));
        CHECK(cuFileRead(dfh, dst, 777, 13, 3) == 777);
        CHECK(memcmp(dst + 3, src + 13, 777) == 0);
        cuFileHandleDeregister(dfh);
        close(dfd);
    }

    /* memory the process cannot touch is an error, not a crash */
    void *none = mmap(NULL, 65536, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(none != MAP_FAILED);
    CHECK(cuFileRead(fh, none, 4096, 0, 0) < 0);
    CHECK(cuFileWrite(fh, none, 4096, 0, 0) < 0);
    CHECK(cuFileRead(fh, none, 65536, 0, 0) < 0);
    munmap(none, 65536);
    CHECK(cuFileRead(fh, dst, 64, 0, 0) == 64 && memcmp(dst, src, 64) == 0);

    /* registered host buffers */
    OK(cuFileBufRegister(dst, 8192, 0));
    FAILS(cuFileBufRegister(dst, 8192, 0), CU_FILE_MEMORY_ALREADY_REGISTERED);
    FAILS(cuFileBufRegister(NULL, 8192, 0), CU_FILE_INVALID_VALUE);
    CHECK(cuFileRead(fh, dst, 4096, 100, 4096) == 4096);
    CHECK(memcmp(dst + 4096, src + 100, 4096) == 0);
    CHECK(cuFileRead(fh, dst, 4096, 0, 4097) == -CU_FILE_INVALID_MAPPING_RANGE);
    OK(cuFileBufDeregister(dst));
    FAILS(cuFileBufDeregister(dst), CU_FILE_MEMORY_NOT_REGISTERED);

    /* vectored */
    static unsigned char a[1000], b2[3000], c[5000];
    CUfileIOVec_t iov[3] = {{a, sizeof a}, {b2, sizeof b2}, {c, sizeof c}};
    CHECK(cuFileReadv(fh, iov, 3, 500, 0) == 9000);
    CHECK(memcmp(a, src + 500, 1000) == 0 && memcmp(b2, src + 1500, 3000) == 0 &&
          memcmp(c, src + 4500, 5000) == 0);
    CHECK(cuFileWritev(fh, iov, 3, N, 0) == 9000);
    CHECK(cuFileRead(fh, dst, 9000, N, 0) == 9000);
    CHECK(memcmp(dst, src + 500, 9000) == 0);
    CHECK(cuFileReadv(fh, NULL, 3, 0, 0) == -CU_FILE_INVALID_VALUE);
    CHECK(cuFileReadv(fh, iov, 0, 0, 0) == -CU_FILE_INVALID_VALUE);
    CHECK(cuFileReadv(fh, iov, 3, 0, 1) == -CU_FILE_INVALID_VALUE);

    /* batch */
    CUfileBatchHandle_t batch = NULL;
    FAILS(cuFileBatchIOSetUp(&batch, 0), CU_FILE_INVALID_VALUE);
    FAILS(cuFileBatchIOSetUp(&batch, 65), CU_FILE_INVALID_VALUE);
    FAILS(cuFileBatchIOSetUp(NULL, 8), CU_FILE_INVALID_VALUE);
    OK(cuFileBatchIOSetUp(&batch, 8));
    static unsigned char slots[8][4096];
    CUfileIOParams_t io[9];
    for (int i = 0; i < 9; i++) {
        memset(&io[i], 0, sizeof io[i]);
        io[i].mode = CUFILE_BATCH;
        io[i].fh = fh;
        io[i].opcode = CUFILE_READ;
        io[i].cookie = (void *)(uintptr_t)(100 + i);
        io[i].u.batch.devPtr_base = slots[i % 8];
        io[i].u.batch.file_offset = (off_t)(7 - i % 8) * 4096 + 11;
        io[i].u.batch.size = 4096;
    }
    FAILS(cuFileBatchIOSubmit(batch, 9, io, 0), CU_FILE_BATCH_FULL);
    io[3].opcode = (CUfileOpcode_t)7;
    FAILS(cuFileBatchIOSubmit(batch, 8, io, 0), CU_FILE_INVALID_VALUE);
    io[3].opcode = CUFILE_READ;
    io[3].fh = (CUfileHandle_t)(uintptr_t)0xbad;
    FAILS(cuFileBatchIOSubmit(batch, 8, io, 0), CU_FILE_HANDLE_NOT_REGISTERED);
    io[3].fh = fh;
    OK(cuFileBatchIOSubmit(batch, 8, io, 0));
    FAILS(cuFileBatchIOSubmit(batch, 1, io, 0), CU_FILE_BATCH_FULL);
    CUfileIOEvents_t ev[8];
    unsigned got = 0, nr;
    while (got < 8) {
        nr = 8 - got;
        struct timespec t = {5, 0};
        OK(cuFileBatchIOGetStatus(batch, 1, &nr, ev + got, &t));
        CHECK(nr >= 1);
        got += nr;
    }
    for (int i = 0; i < 8; i++) {
        int k = (int)((uintptr_t)ev[i].cookie - 100);
        CHECK(k >= 0 && k < 8);
        CHECK(ev[i].status == CUFILE_COMPLETE && ev[i].ret == 4096);
    }
    for (int k = 0; k < 8; k++) CHECK(memcmp(slots[k], src + (7 - k) * 4096 + 11, 4096) == 0);
    nr = 8;
    FAILS(cuFileBatchIOGetStatus(batch, 9, &nr, ev, NULL), CU_FILE_INVALID_VALUE);
    OK(cuFileBatchIOCancel(batch));
    cuFileBatchIODestroy(batch);
    nr = 8;
    FAILS(cuFileBatchIOGetStatus(batch, 0, &nr, ev, NULL), CU_FILE_INVALID_VALUE);
    cuFileBatchIODestroy(batch);
    cuFileBatchIODestroy(NULL);

    /* stream calls */
    size_t size = 4096;
    off_t foff = 4096, boff = 0;
    ssize_t done = -1;
    OK(cuFileStreamRegister(NULL, CU_FILE_STREAM_FIXED_BUF_OFFSET));
    FAILS(cuFileStreamRegister(NULL, 0x100), CU_FILE_INVALID_VALUE);
    OK(cuFileReadAsync(fh, dst, &size, &foff, &boff, &done, NULL));
    CHECK(done == 4096 && memcmp(dst, src + 4096, 4096) == 0);
    boff = 4096; /* writes back the bytes that are there: the file stays equal to src */
    OK(cuFileWriteAsync(fh, src, &size, &foff, &boff, &done, NULL));
    CHECK(done == 4096);
    boff = 0;
    FAILS(cuFileReadAsync(fh, dst, NULL, &foff, &boff, &done, NULL), CU_FILE_INVALID_VALUE);
    FAILS(cuFileReadAsync(fh, dst, &size, &foff, &boff, NULL, NULL), CU_FILE_INVALID_VALUE);
    OK(cuFileStreamDeregister(NULL));
    FAILS(cuFileStreamDeregister(NULL), CU_FILE_INVALID_VALUE);

    /* statistics */
    CUfileStatsLevel1_t s1;
    CUfileStatsLevel3_t s3;
    int lvl = -1;
    OK(cuFileStatsStop());
    FAILS(cuFileGetStatsL1(&s1), CU_FILE_INVALID_VALUE);
    FAILS(cuFileSetStatsLevel(4), CU_FILE_INVALID_VALUE);
    OK(cuFileSetStatsLevel(3));
    OK(cuFileGetStatsLevel(&lvl));
    CHECK(lvl == 3);
    OK(cuFileStatsStart());
    OK(cuFileGetStatsL1(&s1));
    CHECK(s1.read_ops.ok > 0 && s1.read_bytes > 0 && s1.write_ops.ok > 0);
    CHECK(s1.batch_submit_ops.ok == 1 && s1.readv_ops.ok == 1 && s1.hdl_register_ops.ok >= 2);
    OK(cuFileGetStatsL3(&s3));
    CHECK(s3.detailed.basic.read_ops.ok == s1.read_ops.ok);
    OK(cuFileStatsReset());
    OK(cuFileGetStatsL1(&s1));
    CHECK(s1.read_ops.ok == 0);
    FAILS(cuFileGetStatsL2(NULL), CU_FILE_INVALID_VALUE);

    Cuda cu;
    int with_cuda = 0;
    if (argc > 2 && strcmp(argv[2], "cuda") == 0) {
        if (!load_cuda(&cu)) {
            fprintf(stderr, "cuda asked for, and no CUDA driver or device\n");
            failures++;
        } else {
            with_cuda = 1;
            device_checks(&cu, fh, src, 1 << 20);
        }
    }
    cold_direct_checks(argv[1], with_cuda ? &cu : NULL);

    /* a file that shrank under a registered handle: reads past its new end are short */
    CHECK(ftruncate(fd, 10000) == 0);
    CHECK(cuFileRead(fh, dst, 4096, 8000, 0) == 2000);
    CHECK(memcmp(dst, src + 8000, 2000) == 0);
    CHECK(cuFileRead(fh, dst, 4096, 12000, 0) == 0);

    /* close: the driver forgets what was registered */
    cuFileHandleDeregister(fh);
    OK(cuFileDriverClose());
    CHECK(cuFileUseCount() == 0);
    FAILS(cuFileDriverClose(), CU_FILE_DRIVER_NOT_INITIALIZED);
    OK(cuFileDriverOpen());
    OK(cuFileDriverOpen());
    CHECK(cuFileUseCount() == 2);
    OK(cuFileDriverClose());
    OK(cuFileDriverClose());
    close(fd);

    if (failures) {
        fprintf(stderr, "%d cuFile checks failed\n", failures);
        return 1;
    }
    printf("all cuFile checks passed\n");
    return 0;
}
