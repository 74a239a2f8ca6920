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
// Every call word (the head's and the indices') carries its call's tag in its top 16 bits
// (TAG_SHIFT etc. in crates/gpuio-hal/src/gpu/cuda/resident.rs): single-copy atomic, a word
// read with the tag of the call the block serves is that call's. So the block reads the
// words it expects beside the number word while it polls, and a call costs one round trip
// over the bus instead of two (the number, then the words).
#define GPUIO_RESIDENT_TAG_SHIFT 48
#define GPUIO_RESIDENT_PAYLOAD ((1ull << GPUIO_RESIDENT_TAG_SHIFT) - 1ull)

// The call block, as the host writes it (`CallBlock` in crates/gpuio-hal/src/gpu/cuda/
// resident.rs, whose layout is asserted there too). The host writes everything but `done` and
// `bad` and `stop`, then `seq` (the call's number word, below); the device lowers `bad[k]`
// (job k's first bad position, atomicMin), then stores the number word in `done`. `stop` only
// ever grows. Each side's words have a 128-byte line of their own. The head's words and the
// indices are one run of tagged words (`index` follows `job`).
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

// The tag of the call numbered `number` (the host's `tag`): never 0, which the host writes
// over every word now and then so that no word keeps a tag long enough to come round again.
__device__ __forceinline__ gpuio_u64 gpuio_resident_tag(gpuio_u64 number) {
    return number % 0xffffull + 1ull;
}

// Word `at` of the call's run as the call tagged `tag` wrote it: `polled` if that is it, else
// read until it is (the host wrote it before the number the block has seen; the read may
// have been served before the write landed).
__device__ __forceinline__ gpuio_u64 gpuio_resident_word(const volatile gpuio_u64* words,
                                                         unsigned at, gpuio_u64 polled,
                                                         gpuio_u64 tag) {
    gpuio_u64 w = polled;
    while ((w >> GPUIO_RESIDENT_TAG_SHIFT) != tag) w = gpuio_load_relaxed_sys(words + at);
    return w & GPUIO_RESIDENT_PAYLOAD;
}

// Where item `i` of a call with `head` head words lies in the run: the head's words, then the
// indices (which start after all GPUIO_RESIDENT_HEAD).
__device__ __forceinline__ unsigned gpuio_resident_at(unsigned i, unsigned head) {
    return i < head ? i : GPUIO_RESIDENT_HEAD + (i - head);
}

// One block of GPUIO_RESIDENT_THREADS. A call's number word is its number times 2048 plus its
// index count (at most GPUIO_RESIDENT_ROWS). While it waits, thread t also reads item t of a
// call shaped as the last one (its head's words and indices), so that a call like the last is
// all read in the round that finds its number. `seen`: the last word served (the host's last
// answered call), so that a call posted before the launch is served at once; `stopped`: the
// stop word then.
extern "C" __global__ void __launch_bounds__(GPUIO_RESIDENT_THREADS)
    gpuio_resident_rows(gpuio_resident_call* call, gpuio_u64 seen, gpuio_u64 stopped,
                        gpuio_u64 linger_ns) {
    __shared__ gpuio_u64 idx[GPUIO_RESIDENT_ROWS];
    __shared__ gpuio_u64 head[GPUIO_RESIDENT_HEAD];
    __shared__ gpuio_u64 next;
    __shared__ int leave;
    // The host rewrites the block between calls: every read of it goes to host memory.
    const volatile gpuio_u64* seq_word = &call->seq;
    const volatile gpuio_u64* stop_word = &call->stop;
    const volatile gpuio_u64* words = &call->width;
    const unsigned t = threadIdx.x;
    // The shape polled: the last call's head words and indices (a first call: one job).
    unsigned polled_head = 16u, polled_rows = 0u;
    gpuio_u64 idle_since = gpuio_now_ns();
    for (;;) {
        const unsigned polled_at = gpuio_resident_at(t, polled_head);
        const int polls = t < polled_head + polled_rows;
        gpuio_u64 mine = 0ull;
        for (;;) {
            // The number, the stop word and this thread's item, all in flight together.
            if (polls) mine = gpuio_load_relaxed_sys(words + polled_at);
            if (t == 0) {
                const gpuio_u64 stop = gpuio_load_relaxed_sys(stop_word);
                const gpuio_u64 s = gpuio_load_relaxed_sys(seq_word);
                next = s;
                leave = s == seen && (stop != stopped || gpuio_now_ns() - idle_since >= linger_ns);
            }
            __syncthreads();
            const gpuio_u64 s = next;
            const int go = s != seen || leave;
            __syncthreads();  // everyone has read `next` and `leave` before thread 0 rewrites them
            if (go) break;
        }
        const gpuio_u64 seq = next;
        // No call: the linger passed, or the host asked the block to leave.
        if (seq == seen) return;
        // Acquire: what the host wrote before the number (the pools' rows, the hot tiers) is
        // read after it; the barriers below carry it to every thread.
        if (t == 0) asm volatile("fence.acq_rel.sys;" ::: "memory");
        const gpuio_u64 tag = gpuio_resident_tag(seq / 2048);
        const gpuio_u64 count = seq % 2048;
        const unsigned rows = count < GPUIO_RESIDENT_ROWS ? (unsigned)count : GPUIO_RESIDENT_ROWS;
        // The head's first four words (width, row_bytes, jobs, rows) tell its shape.
        if (t < 4) head[t] = gpuio_resident_word(words, t, t == polled_at ? mine : 0ull, tag);
        __syncthreads();
        const gpuio_u64 n = head[2] < GPUIO_HOT_JOBS ? head[2] : GPUIO_HOT_JOBS;
        const unsigned head_words = 4u + 12u * (unsigned)n;
        for (unsigned i = t; i < head_words + rows; i += blockDim.x) {
            if (i < 4) continue;
            const unsigned at = gpuio_resident_at(i, head_words);
            const gpuio_u64 w =
                gpuio_resident_word(words, at, i == t && at == polled_at ? mine : 0ull, tag);
            if (at < GPUIO_RESIDENT_HEAD)
                head[at] = w;
            else
                idx[at - GPUIO_RESIDENT_HEAD] = w;
        }
        __syncthreads();
        const gpuio_hot_job* jobs = (const gpuio_hot_job*)(head + 4);
        switch (head[0]) {
        case 16: gpuio_resident_jobs<16>(jobs, n, head[1], idx, call->bad); break;
        case 8: gpuio_resident_jobs<8>(jobs, n, head[1], idx, call->bad); break;
        case 4: gpuio_resident_jobs<4>(jobs, n, head[1], idx, call->bad); break;
        default: gpuio_resident_jobs<1>(jobs, n, head[1], idx, call->bad); break;
        }
        // Every thread's rows before the number (the barrier, then a fence: fences are
        // cumulative).
        __syncthreads();
        if (t == 0) {
            __threadfence_system();
            *(volatile gpuio_u64*)&call->done = seq;
        }
        seen = seq;
        polled_head = head_words;
        polled_rows = rows;
        idle_since = gpuio_now_ns();
    }
}
