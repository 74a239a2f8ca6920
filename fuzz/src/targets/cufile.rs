//! cuFile API arguments: sequences of calls into gpuio's `libcufile.so.0` through its C entry
//! points, with handles, batch ids, offsets, sizes, parameters and batch entries the fuzzer
//! chooses (`gpuio_cufile::fuzzing`, which says what must hold: no panic inside any call,
//! reads that return the file's bytes, batches that hand over no more than was submitted).

use crate::Target;
use arbitrary::{Arbitrary, Unstructured};
use cufile::fuzzing::{self, Op};

pub const TARGET: Target = Target {
    name: "cufile",
    parses: "cuFile API arguments (handles, buffers, offsets, batches, parameters)",
    sources: &[
        "crates/gpuio-cufile/src/exports/batch.rs",
        "crates/gpuio-cufile/src/exports/driver.rs",
        "crates/gpuio-cufile/src/exports/io.rs",
        "crates/gpuio-cufile/src/exports/params.rs",
        "crates/gpuio-cufile/src/exports/stats.rs",
        "crates/gpuio-cufile/src/batch.rs",
        "crates/gpuio-cufile/src/io.rs",
        "crates/gpuio-cufile/src/memory.rs",
        "crates/gpuio-cufile/src/params.rs",
    ],
    run,
    seeds,
};

fn run(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let Ok(ops) = Vec::<Op>::arbitrary(&mut u) else {
        return;
    };
    fuzzing::run(&ops);
}

/// Byte strings that decode to call sequences through each part of the API (arbitrary's
/// encoding: a variant index, then the fields).
fn seeds() -> Vec<Vec<u8>> {
    let mut out = vec![Vec::new()];
    for first in 0u8..21 {
        let mut s = vec![first];
        s.extend((0u8..48).map(|i| i.wrapping_mul(37) ^ first));
        out.push(s);
    }
    out
}
