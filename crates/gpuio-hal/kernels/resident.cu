// A resident row server: one block that stays on the device and takes small gathers (the hot
// gathers' jobs, gather.cu's gpuio_hot_job) from a call block in mapped host memory. A call
// then costs no launch and no driver wait: the host writes the call and its number, the block
// sees the number, copies the rows, and stores the number back; the host watches for it.
// On an H200 a launch call alone takes 4-5 us, most of a few-row gather's wall time.
//
// The block leaves after `linger_ns` without a call, or once the host has raised the stop
// word (before a device-wide wait, which would otherwise last the linger) and no call is
// waiting: a posted call is always served first. The host launches it again when it finds the
// stream idle with a call unanswered (crates/gpuio-hal/src/gpu/cuda/resident.rs).

#define GPUIO_RESIDENT_ROWS 1024    // RESIDENT_MAX_ROWS in crates/gpuio-hal/src/gpu/resident.rs
#define GPUIO_RESIDENT_THREADS 512  // RESIDENT_THREADS in crates/gpuio-hal/src/gpu/cuda/resident.rs
// The call's words the block reads before its jobs: width, row_bytes, jobs, rows, the jobs.
#define GPUIO_RESIDENT_HEAD (4 + 12 * GPUIO_HOT_JOBS)

// The call block, as the host writes it (`CallBlock` in crates/gpuio-hal/src/gpu/cuda/
// resident.rs, whose layout is asserted there too). The host writes everything but `done` and
// `bad` and `stop`, then `seq` (the call's number word, below); the device lowers `bad[k]`
// (job k's first bad position, atomicMin), then stores the number word in `done`. `stop` only
// ever grows. Each side's words have a 128-byte line of their own.
struct gpuio_resident_call {
    gpuio_u64 seq, stop;
    gpuio_u64 unused0[14];
    gpuio_u64 done;
    gpuio_u64 bad[GPUIO_HOT_JOBS];
    gpuio_u64 unused1[7];
    gpuio_u64 width, row_bytes, jobs, rows;
    // A job's `idx` is its first index's position in `index`; `err` is unused (`bad[k]`).
    gpuio_hot_job job[GPUIO_HOT_JOBS];
    gpuio_u64 index[GPUIO_RESIDENT_ROWS];
};
static_assert(sizeof(gpuio_resident_call) == 288 + 96 * GPUIO_HOT_JOBS + 8 * GPUIO_RESIDENT_ROWS,
              "gpuio_resident_call size");
#ifndef __CUDACC_RTC__
static_assert(__builtin_offsetof(gpuio_resident_call, stop) == 8, "resident_call.stop");
static_assert(__builtin_offsetof(gpuio_resident_call, done) == 128, "resident_call.done");
static_assert(__builtin_offsetof(gpuio_resident_call, bad) == 136, "resident_call.bad");
static_assert(__builtin_offsetof(gpuio_resident_call, width) == 256, "resident_call.width");
static_assert(__builtin_offsetof(gpuio_resident_call, job) == 288, "resident_call.job");
static_assert(__builtin_offsetof(gpuio_resident_call, index) == 288 + 96 * GPUIO_HOT_JOBS,
              "resident_call.index");
#endif

__device__ __forceinline__ gpuio_u64 gpuio_now_ns() {
    gpuio_u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

__device__ __forceinline__ gpuio_u64 gpuio_load_acquire_sys(const volatile gpuio_u64* p) {
    gpuio_u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// A load coherent with the host's stores (system scope), ordering nothing.
__device__ __forceinline__ gpuio_u64 gpuio_load_relaxed_sys(const volatile gpuio_u64* p) {
    gpuio_u64 v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

template <int W>
__device__ __forceinline__ void gpuio_resident_jobs(const gpuio_hot_job* jobs, gpuio_u64 count,
                                                    gpuio_u64 row_bytes, const gpuio_u64* idx,
                                                    gpuio_u64* bad) {
    for (gpuio_u64 k = 0; k < count; k++) {
        const gpuio_hot_job& j = jobs[k];
        gpuio_hot_rows<W>((const unsigned char*)j.pool, j.rows, row_bytes, idx + j.idx, j.n,
                          (unsigned char*)j.dst, bad + k, (const unsigned char*)j.hot,
                          j.hot_rows, (const gpuio_u64*)j.index, j.mask, (gpuio_u32)j.probes);
    }
}

// One block of GPUIO_RESIDENT_THREADS. A call's number word is its number times 2048 plus its
// index count (at most GPUIO_RESIDENT_ROWS), so that the block reads the call's words and its
// indices in one round trip. `seen`: the last word served (the host's last answered call), so
// that a call posted before the launch is served at once; `stopped`: the stop word then.
extern "C" __global__ void __launch_bounds__(GPUIO_RESIDENT_THREADS)
    gpuio_resident_rows(gpuio_resident_call* call, gpuio_u64 seen, gpuio_u64 stopped,
                        gpuio_u64 linger_ns) {
    __shared__ gpuio_u64 idx[GPUIO_RESIDENT_ROWS];
    __shared__ gpuio_u64 head[GPUIO_RESIDENT_HEAD];
    __shared__ gpuio_u64 next;
    // The host rewrites the block between calls: every read of it goes to host memory.
    const volatile gpuio_u64* seq_word = &call->seq;
    const volatile gpuio_u64* stop_word = &call->stop;
    const volatile gpuio_u64* words = &call->width;
    const volatile gpuio_u64* index = call->index;
    gpuio_u64 idle_since = gpuio_now_ns();
    for (;;) {
        if (threadIdx.x == 0) {
            // Both words each round, the stop word's load in flight beside the number's.
            // Acquire: what the host wrote before the number is read after it.
            gpuio_u64 s, stop;
            do {
                stop = gpuio_load_relaxed_sys(stop_word);
                s = gpuio_load_acquire_sys(seq_word);
            } while (s == seen && stop == stopped && gpuio_now_ns() - idle_since < linger_ns);
            next = s;
        }
        __syncthreads();
        const gpuio_u64 seq = next;
        // No call: the linger passed, or the host asked the block to leave.
        if (seq == seen) return;
        const gpuio_u64 count = seq % 2048;
        const unsigned rows = count < GPUIO_RESIDENT_ROWS ? (unsigned)count : GPUIO_RESIDENT_ROWS;
        for (unsigned t = threadIdx.x; t < GPUIO_RESIDENT_HEAD + rows; t += blockDim.x) {
            if (t < GPUIO_RESIDENT_HEAD)
                head[t] = words[t];
            else
                idx[t - GPUIO_RESIDENT_HEAD] = index[t - GPUIO_RESIDENT_HEAD];
        }
        __syncthreads();
        const gpuio_hot_job* jobs = (const gpuio_hot_job*)(head + 4);
        const gpuio_u64 n = head[2] < GPUIO_HOT_JOBS ? head[2] : GPUIO_HOT_JOBS;
        switch (head[0]) {
        case 16: gpuio_resident_jobs<16>(jobs, n, head[1], idx, call->bad); break;
        case 8: gpuio_resident_jobs<8>(jobs, n, head[1], idx, call->bad); break;
        case 4: gpuio_resident_jobs<4>(jobs, n, head[1], idx, call->bad); break;
        default: gpuio_resident_jobs<1>(jobs, n, head[1], idx, call->bad); break;
        }
        // Every thread's rows before the number (the barrier, then a fence: fences are
        // cumulative).
        __syncthreads();
        if (threadIdx.x == 0) {
            __threadfence_system();
            *(volatile gpuio_u64*)&call->done = seq;
        }
        seen = seq;
        idle_since = gpuio_now_ns();
    }
}
