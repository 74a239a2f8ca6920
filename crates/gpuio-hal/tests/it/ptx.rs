//! The embedded PTX covers every kernel module gpuio loads, for every architecture it is built
//! for, and was built from the sources gpuio embeds now. No GPU and no compiler are needed: each
//! PTX file's first line records the hash of the source nvcc built it from, which is compared
//! with the embedded source's. (`cargo xtask ptx --check` compares the whole text with a fresh
//! build; this test tells a stale file in every `cargo test`.)

use gpuio_hal::kernels::{MODULES, PTX_ARCHS};

const REGENERATE: &str = "after changing kernels/, run `cargo xtask ptx --wheels --write` and \
                          commit crates/gpuio-hal/ptx";

fn file(name: &str, arch: u32) -> String {
    let stem = name.strip_suffix(".cu").unwrap_or(name);
    format!("crates/gpuio-hal/ptx/{stem}.compute_{arch}.ptx")
}

#[test]
fn every_module_has_ptx_for_every_architecture() {
    assert!(!MODULES.is_empty());
    for src in MODULES {
        let archs: Vec<u32> = src.ptx.iter().map(|p| p.arch).collect();
        assert_eq!(archs, PTX_ARCHS, "{}: embedded PTX architectures", src.name);
    }
}

#[test]
fn embedded_ptx_was_built_from_the_embedded_source() {
    let mut stale = Vec::new();
    for src in MODULES {
        let want = format!(
            "// gpuio-ptx: {} compute_{{}} source-fnv1a64 {:016x}",
            src.name,
            src.source_hash()
        );
        for ptx in src.ptx {
            let first = ptx.text.lines().next().unwrap_or("");
            if first != want.replace("{}", &ptx.arch.to_string()) {
                stale.push(format!(
                    "{} was built from another source than kernels/ holds now (its first line: \
                     {first:?})",
                    file(src.name, ptx.arch)
                ));
            }
        }
    }
    assert!(stale.is_empty(), "{}\n{REGENERATE}", stale.join("\n"));
}

#[test]
fn embedded_ptx_targets_its_architecture_and_defines_every_kernel() {
    for src in MODULES {
        for ptx in src.ptx {
            let path = file(src.name, ptx.arch);
            assert!(!ptx.text.contains('\0'), "{path} contains a NUL byte");
            let target = format!(".target sm_{}", ptx.arch);
            assert!(
                ptx.text.lines().any(|l| l.trim() == target),
                "{path} lacks {target:?}"
            );
            for f in src.functions {
                assert!(
                    ptx.text.contains(&format!(".entry {f}(")),
                    "{path} does not define {f}; {REGENERATE}"
                );
            }
        }
    }
}
