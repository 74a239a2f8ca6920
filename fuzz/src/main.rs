//! The AFL++ harness, built by `cargo afl build` and run through `cargo xtask fuzz`:
//!
//! - `gpuio-fuzz TARGET`: one input per run of the target, in persistent mode; a panic or an
//!   allocation past the limit aborts, which AFL++ records as a crash;
//! - `gpuio-fuzz seeds TARGET DIR`: writes the target's seeds into DIR;
//! - `gpuio-fuzz sources TARGET`: the source files and folders of the parsers it reaches.

#![forbid(unsafe_code)]

use std::path::Path;
use std::process::ExitCode;

fn usage() -> ExitCode {
    let names: Vec<&str> = gpuio_fuzz::TARGETS.iter().map(|t| t.name).collect();
    eprintln!(
        "usage: gpuio-fuzz TARGET | gpuio-fuzz seeds TARGET DIR | gpuio-fuzz sources TARGET \
         (targets: {})",
        names.join(", ")
    );
    ExitCode::FAILURE
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [seeds, name, dir] if seeds == "seeds" => {
            let Some(target) = gpuio_fuzz::target(name) else {
                return usage();
            };
            for (i, seed) in (target.seeds)().iter().enumerate() {
                let path = Path::new(dir).join(format!("seed-{i:03}"));
                if let Err(e) = std::fs::write(&path, seed) {
                    eprintln!("{}: {e}", path.display());
                    return ExitCode::FAILURE;
                }
            }
            ExitCode::SUCCESS
        }
        [sources, name] if sources == "sources" => {
            let Some(target) = gpuio_fuzz::target(name) else {
                return usage();
            };
            for s in target.sources {
                println!("{s}");
            }
            ExitCode::SUCCESS
        }
        [name] => {
            let Some(target) = gpuio_fuzz::target(name) else {
                return usage();
            };
            afl::fuzz!(|data: &[u8]| gpuio_fuzz::run(target, data));
            ExitCode::SUCCESS
        }
        _ => usage(),
    }
}
