//! The LocalIO suite's host-memory part: a file into host memory and back, on the IO threads.
//!
//! - `host_read_warm`: the page-cached test file into a pinned gpuio buffer, against one
//!   thread's `pread` loop into the same buffer (what Python's `readinto` does) and fio (to
//!   host memory, same threads).
//! - `host_read_cold`: the same with the file's pages dropped before each read, buffered and
//!   O_DIRECT, against the disk: fio O_DIRECT on the same threads, or where fio is absent as
//!   many `dd iflag=direct` processes over shares of the file.
//! - `host_write_sync`: the buffer to a file, then `fdatasync`, against fio write + fsync (or
//!   parallel `dd conv=fdatasync`).
//! - `py_host_*` (where gpuio's Python binding runs): into a NumPy array, a CPU torch tensor
//!   and a pinned gpuio buffer through the binding, and an array to a new file with
//!   `durable=True`, against `readinto`, `numpy.fromfile`, `torch.load` and `write` + `fsync`
//!   in the same process.

use super::{Cleanup, api, peer, time_it};
use crate::peers::{self, FioJob};
use crate::{Record, Result, human};
use gpuio_api::{Durability, FileHandle, OpenOptions};
use gpuio_hal::{Gpu, HostAllocOptions, HostBuffer, pattern};
use gpuio_transport_localio::LocalIo;
use std::path::Path;
use std::time::Duration;

/// Where the part runs: the engine, the test file (pattern `seed`), the scratch directory.
pub(super) struct HostPart<'a> {
    pub(super) io: &'a LocalIo,
    pub(super) gpu: &'a Gpu,
    pub(super) path: &'a Path,
    pub(super) size: u64,
    pub(super) seed: u64,
    pub(super) reps: usize,
    pub(super) fio: FioJob<'a>,
    pub(super) device: String,
}

impl HostPart<'_> {
    /// A GB/s record of `case` (the file's size appended) against `peer`.
    fn record(&self, case: &str, value: f64, peer: &str, peer_value: f64, route: &str) -> Record {
        Record {
            bytes: self.size as usize,
            route: route.into(),
            device: self.device.clone(),
            reps: self.reps,
            ..Record::versus(
                super::SUITE,
                (
                    &format!("{case}/{}", human(self.size as usize)),
                    "bandwidth",
                    "GB/s",
                ),
                value,
                peer,
                peer_value,
                true,
            )
        }
    }
}

fn corrupt(case: &str, size: usize, at: Option<usize>) -> Result<()> {
    match at {
        None => Ok(()),
        Some(off) => Err(crate::BenchError::Corrupt {
            case: case.into(),
            size,
            offset: off as u64,
        }),
    }
}

/// Runs the part.
pub(super) fn run(
    p: &HostPart<'_>,
    notes: &mut Vec<String>,
    progress: &mut dyn FnMut(&str),
) -> Result<Vec<Record>> {
    let mut records = Vec::new();
    let mut record = |case: &str, v: f64, peer: &str, pv: f64, route: &str| {
        records.push(p.record(case, v, peer, pv, route));
    };
    let len = p.size as usize;
    let gbps = |t: Duration| p.size as f64 / t.as_secs_f64().max(1e-9) / 1e9;
    let io = p.io;
    let file = io.open(p.path, OpenOptions::READ).map_err(api)?;
    let mut buf = HostBuffer::alloc_pinned(len, &HostAllocOptions::default(), p.gpu)?;
    let threads = io.config().host_threads;

    progress("host_read_warm");
    let mut route = String::new();
    let t = time_it(
        p.reps,
        || Ok(()),
        || {
            let t = io.read_to_host(&file, 0, &mut buf[..]).map_err(api)?;
            route = t.to_string();
            Ok(())
        },
    )?;
    corrupt(
        "host_read_warm",
        len,
        pattern::first_deviation(&buf[..], 0, p.seed),
    )?;
    let ours = gbps(t);
    let one_thread = time_it(
        p.reps,
        || Ok(()),
        || file.read_exact_at(0, &mut buf[..]).map_err(api),
    )?;
    record(
        "host_read_warm",
        ours,
        "one thread's read() (Python's readinto)",
        gbps(one_thread),
        &route,
    );
    if let Some(f) = peer(notes, "fio warm (host)", peers::fio(&p.fio, 3)) {
        record(
            "host_read_warm",
            ours,
            &format!("fio ({threads} jobs, to host memory)"),
            f.bytes_per_s / 1e9,
            &route,
        );
    }

    progress("host_read_cold");
    let disk_job = FioJob {
        direct: true,
        numjobs: threads,
        iodepth: 2,
        ..p.fio.clone()
    };
    let disk = peer(notes, "the disk (host)", peers::storage(&disk_job, 3));
    let direct = io.open(p.path, OpenOptions::READ.direct()).ok();
    for (name, f) in [("buffered", Some(&file)), ("odirect", direct.as_ref())] {
        let Some(f) = f else {
            notes.push("host_read_cold: O_DIRECT is refused on the scratch file system".into());
            continue;
        };
        let cold = |f: &FileHandle| f.drop_cache().map_err(api);
        let t = time_it(
            p.reps.min(3),
            || cold(f),
            || io.read_to_host(f, 0, &mut buf[..]).map(drop).map_err(api),
        )?;
        corrupt(
            "host_read_cold",
            len,
            pattern::first_deviation(&buf[..], 0, p.seed),
        )?;
        if let Some((d, tool)) = &disk {
            record(
                &format!("host_read_cold_{name}"),
                gbps(t),
                &format!("{tool} O_DIRECT x {threads} (the disk)"),
                d.bytes_per_s / 1e9,
                &route,
            );
        }
    }

    progress("host_write_sync");
    let out_path = p.path.with_extension("host-out");
    let _cleanup = Cleanup(vec![out_path.clone()]);
    pattern::fill(&mut buf[..], 0, p.seed ^ 7);
    let out = io.open(&out_path, OpenOptions::CREATE).map_err(api)?;
    let mut write_route = String::new();
    let t = time_it(
        p.reps.min(3),
        || Ok(()),
        || {
            let t = io
                .write_from_host(&buf[..], &out, 0, Durability::DataSync)
                .map_err(api)?;
            write_route = t.to_string();
            Ok(())
        },
    )?;
    let mut head = vec![0u8; len.min(16 << 20)];
    out.read_exact_at(0, &mut head).map_err(api)?;
    corrupt(
        "host_write_sync",
        len,
        pattern::first_deviation(&head, 0, p.seed ^ 7),
    )?;
    let write_job = FioJob {
        path: &out_path,
        rw: "write",
        end_fsync: true,
        ..p.fio.clone()
    };
    if let Some((w, tool)) = peer(notes, "write (host)", peers::storage(&write_job, 3)) {
        record(
            "host_write_sync",
            gbps(t),
            &format!("{tool} write+fsync x {threads}"),
            w.bytes_per_s / 1e9,
            &write_route,
        );
    }
    drop(buf);

    progress("py_host");
    let args = [p.path.display().to_string(), p.reps.to_string()];
    match peers::python_binding("host", &args) {
        Ok(py) => python_records(&py, notes, &mut record)?,
        Err(why) => notes.push(format!("py_host: {why}")),
    }
    Ok(records)
}

/// The binding's figures (`python_suite.py host`): each of gpuio's against the peers it
/// printed beside it, every result checked there against the file's bytes.
fn python_records(
    py: &serde_json::Value,
    notes: &mut Vec<String>,
    record: &mut dyn FnMut(&str, f64, &str, f64, &str),
) -> Result<()> {
    if py["correct"].as_bool() != Some(true) {
        return Err(crate::BenchError::Options(format!(
            "py_host: a read or write through the binding differs: {}",
            py["mismatch"]
        )));
    }
    let gb = |k: &str| py[k].as_f64().map(|b| b / 1e9);
    let pairs: &[(&str, &str, &str, &str)] = &[
        ("py_host_numpy_warm", "gpuio_numpy", "readinto", "readinto"),
        (
            "py_host_numpy_warm",
            "gpuio_numpy_fresh",
            "fromfile",
            "numpy.fromfile",
        ),
        (
            "py_host_numpy_cold",
            "gpuio_numpy_cold",
            "readinto_cold",
            "readinto (cold)",
        ),
        (
            "py_host_pinned_warm",
            "gpuio_pinned",
            "readinto_pinned",
            "readinto",
        ),
        (
            "py_host_torch_warm",
            "gpuio_torch",
            "torch_load",
            "torch.load (raw tensor)",
        ),
        (
            "py_host_numpy_write",
            "gpuio_write",
            "write",
            "write + fsync",
        ),
    ];
    for (case, ours, peer_key, peer_name) in pairs {
        match (gb(ours), gb(peer_key)) {
            (Some(v), Some(p)) => record(case, v, peer_name, p, "Python binding"),
            _ => notes.push(format!(
                "{case}: not measured ({})",
                py[format!("{peer_key}_absent")]
                    .as_str()
                    .unwrap_or("no figure")
            )),
        }
    }
    Ok(())
}
