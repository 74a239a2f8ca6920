//! The LocalIO suite's targets, judged on a run's records.

use crate::{Record, Target};

/// The LocalIO issue's targets, judged on this run's records.
pub fn targets(records: &[Record], lanes: usize) -> Vec<Target> {
    let peer_is = |case: &'static str, peer: &'static str| {
        move |r: &Record| r.case.starts_with(case) && r.peer.starts_with(peer)
    };
    vec![
        Target::judge(
            "warm read -> GPU >= 1.1x kvikio (same threads)",
            records,
            peer_is("seq_read_warm", "kvikio"),
            |r| r.ratio,
            1.1,
            "x",
        ),
        Target::judge(
            &format!("warm read -> GPU >= 50 GB/s ({lanes} lanes, at most 8)"),
            records,
            |r| r.case.starts_with("seq_read_warm/") && lanes <= 8,
            |r| r.value,
            50.0,
            " GB/s",
        ),
        Target::judge(
            "hot file (kept registration) -> GPU >= 0.98x pinned cudaMemcpy",
            records,
            peer_is("seq_read_hot", "cudaMemcpy"),
            |r| r.ratio,
            0.98,
            "x",
        ),
        Target::judge(
            "warm read -> GPU >= 50 GB/s with 2 threads",
            records,
            |r| r.case.starts_with("seq_read_warm_2threads/"),
            |r| r.value,
            50.0,
            " GB/s",
        ),
        Target::judge(
            "cold O_DIRECT read -> GPU >= 0.95x fio O_DIRECT read",
            records,
            peer_is("seq_read_cold", "fio"),
            |r| r.ratio,
            0.95,
            "x",
        ),
        Target::judge(
            "cold read -> GPU >= 1.3x kvikio cold",
            records,
            peer_is("seq_read_cold", "kvikio"),
            |r| r.ratio,
            1.3,
            "x",
        ),
        Target::judge(
            "GPU -> file + fdatasync >= 0.95x fio write",
            records,
            peer_is("seq_write_sync", "fio"),
            |r| r.ratio,
            0.95,
            "x",
        ),
        Target::judge(
            "warm file -> pinned host buffer >= 25 GB/s",
            records,
            peer_is("host_read_warm", "one thread"),
            |r| r.value,
            25.0,
            " GB/s",
        ),
        Target::judge(
            "warm file -> NumPy array (Python) >= 4x readinto",
            records,
            peer_is("py_host_numpy_warm", "readinto"),
            |r| r.ratio,
            4.0,
            "x",
        ),
        Target::judge(
            "warm file -> NumPy array or CPU tensor (Python) >= 20 GB/s",
            records,
            |r| {
                (r.case.starts_with("py_host_numpy_warm") && r.peer == "readinto")
                    || r.case.starts_with("py_host_torch_warm")
            },
            |r| r.value,
            20.0,
            " GB/s",
        ),
        Target::judge(
            "cold file -> host memory >= 0.95x the disk (fio or dd O_DIRECT)",
            records,
            |r| r.case.starts_with("host_read_cold_buffered") && r.peer.ends_with("(the disk)"),
            |r| r.ratio,
            0.95,
            "x",
        ),
        Target::judge(
            "host memory -> file + fdatasync >= 0.95x fio (or dd) write+fsync",
            records,
            |r| r.case.starts_with("host_write_sync") && r.peer.contains("write+fsync"),
            |r| r.ratio,
            0.95,
            "x",
        ),
        Target::judge(
            "second read of any size >= 0.9x the same read through the lanes",
            records,
            peer_is("second_read", "the same read"),
            |r| r.ratio,
            0.9,
            "x",
        ),
        Target::judge(
            "random 4 KiB -> GPU >= 10x kvikio futures",
            records,
            peer_is("rand_read_4k", "kvikio"),
            |r| r.ratio,
            10.0,
            "x",
        ),
        Target::judge(
            "random 4 KiB -> GPU >= 0.8x fio io_uring IOPS",
            records,
            peer_is("rand_read_4k", "fio"),
            |r| r.ratio,
            0.8,
            "x",
        ),
        Target::judge(
            "kvikio on gpuio's libcufile >= 1.2x on NVIDIA's (warm, same threads)",
            records,
            |r| r.case.starts_with("cufile_kvikio_warm/"),
            |r| r.ratio,
            1.2,
            "x",
        ),
        Target::judge(
            "kvikio on gpuio's libcufile >= 1.2x on NVIDIA's (hot, same threads)",
            records,
            |r| r.case.starts_with("cufile_kvikio_hot/"),
            |r| r.ratio,
            1.2,
            "x",
        ),
        Target::judge(
            "kvikio on gpuio's libcufile, cold >= 0.95x the disk",
            records,
            |r| r.case.starts_with("cufile_kvikio_cold_vs_disk/"),
            |r| r.ratio,
            0.95,
            "x",
        ),
        Target::judge(
            "kvikio on gpuio's libcufile, 4 KiB random >= 10x on NVIDIA's",
            records,
            |r| r.case.starts_with("cufile_kvikio_4k_random/"),
            |r| r.ratio,
            10.0,
            "x",
        ),
        Target::judge(
            "torch.cuda.gds on gpuio's libcufile, warm 4 GiB >= 40 GB/s",
            records,
            |r| r.case == "cufile_torch_gds_warm",
            |r| r.value,
            40.0,
            " GB/s",
        ),
    ]
}
