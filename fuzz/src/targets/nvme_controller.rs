//! The NVMe driver against a hostile controller: the software controller answering Identify
//! with pages of the fuzzer's and rewriting I/O completions (another command's identifier,
//! a forged status, duplicates, lost completions), while the driver brings it up and reads.
//!
//! What must hold: bring-up either gives a controller with namespaces the driver can address
//! or is a typed error; every read ends, within the command timeout, with its data or a
//! typed error; where the controller only ever lost completions (it never forged one), a read
//! that succeeds delivered the namespace's bytes. The timeout is 1 ms, some 100 commands' time
//! on one core: a lost completion is common here, and each costs the whole timeout.

use crate::Target;
use arbitrary::{Arbitrary, Unstructured};
use gpuio_hal::HalError;
use gpuio_nvme::spec::PAGE;
use gpuio_nvme::{
    Controller, ControllerOptions, CqeTamper, SoftConfig, SoftController, SoftFaults,
};
use std::sync::OnceLock;
use std::time::Duration;

pub const TARGET: Target = Target {
    name: "nvme-controller",
    parses: "Identify pages and I/O completions of a hostile NVMe controller, through the driver",
    sources: &[
        "crates/gpuio-nvme/src/controller.rs",
        "crates/gpuio-nvme/src/queue.rs",
        "crates/gpuio-nvme/src/spec.rs",
    ],
    run,
    seeds,
};

/// Blocks of the one namespace (512 bytes each).
const BLOCKS: u64 = 64;

#[derive(Arbitrary, Debug)]
struct Hostile {
    /// CNS and the first bytes of a forged Identify page (the rest zero).
    identify: Vec<(u8, Vec<u8>)>,
    tamper: Vec<CqeTamper>,
    /// Reads: first block, blocks, buffer offset in dwords.
    reads: Vec<(u8, u8, u8)>,
}

fn run(data: &[u8]) {
    let Ok(h) = Hostile::arbitrary(&mut Unstructured::new(data)) else {
        return;
    };
    let (dev, truth) = device();
    let tamper: Vec<CqeTamper> = h.tamper.into_iter().take(32).collect();
    let forged_only_losses = tamper.iter().all(|t| t.lose || *t == CqeTamper::default());
    let identify = h
        .identify
        .iter()
        .take(3)
        .map(|(cns, bytes)| {
            let mut page = Box::new([0u8; PAGE]);
            let n = bytes.len().min(PAGE);
            page[..n].copy_from_slice(&bytes[..n]);
            (*cns % 3, page)
        })
        .collect();
    dev.set_faults(SoftFaults {
        tamper,
        identify,
        ..SoftFaults::default()
    });
    let options = ControllerOptions {
        command_timeout: Duration::from_millis(1),
    };
    let ctrl = match Controller::enable(dev.registers(), dev.mapper(), options) {
        Ok(c) => c,
        Err(e) => return typed(&e),
    };
    let Some(&nsid) = ctrl.namespaces().first() else {
        return;
    };
    let ns = match ctrl.namespace(nsid) {
        Ok(ns) => ns,
        Err(e) => return typed(&e),
    };
    let mut qp = match ctrl.io_queue_pair(8) {
        Ok(qp) => qp,
        Err(e) => return typed(&e),
    };
    let bs = ns.identity.block_size as usize;
    let Ok(buf) = ctrl.dma_buffer(16 * bs + 1024) else {
        return;
    };
    for &(first, blocks, dwords) in h.reads.iter().take(8) {
        let (lba, len, offset) = (
            u64::from(first) % BLOCKS,
            (usize::from(blocks) % 16 + 1) * bs,
            usize::from(dwords) * 4,
        );
        match qp.read(&ns, lba, &buf, offset, len) {
            Ok(()) if forged_only_losses && nsid == 1 && bs == 512 => {
                let mut got = vec![0u8; len];
                buf.read(offset, &mut got).expect("in the buffer");
                let at = lba as usize * bs;
                assert_eq!(got, truth[at..at + len], "read of {len} bytes at LBA {lba}");
            }
            Ok(()) => {}
            Err(e) => typed(&e),
        }
    }
}

/// The software controller of this process and its namespace's bytes. Starting one per input
/// (threads, namespace memory, its pattern) would cost more than the input: each input enables
/// it anew, which resets it, and sets its own faults.
fn device() -> (&'static SoftController, &'static [u8]) {
    static DEVICE: OnceLock<(SoftController, Vec<u8>)> = OnceLock::new();
    let (dev, truth) = DEVICE.get_or_init(|| {
        let config = SoftConfig {
            namespaces: vec![BLOCKS],
            max_queue_entries: 16,
            ..SoftConfig::default()
        };
        let dev = SoftController::start(config).expect("a software controller starts");
        dev.fill_pattern(1, 7).expect("namespace 1 exists");
        let truth = dev.namespace_bytes(1).expect("namespace 1 exists");
        (dev, truth)
    });
    (dev, truth)
}

/// A driver error is one of the kinds a controller's fault can give.
fn typed(e: &HalError) {
    assert!(
        matches!(
            e,
            HalError::NvmeController { .. }
                | HalError::NvmeCommand { .. }
                | HalError::TimedOut { .. }
                | HalError::InvalidArgument(_)
                | HalError::Unsupported { .. }
                | HalError::Busy(_)
        ),
        "unexpected error kind: {e:?}"
    );
}

fn seeds() -> Vec<Vec<u8>> {
    let mut out = vec![Vec::new(), vec![0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]];
    for i in 0..8u8 {
        out.push((0..48).map(|j: u8| j.wrapping_mul(i + 3) ^ i).collect());
    }
    out
}
