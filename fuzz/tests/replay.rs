//! Replays every committed input through its target: the minimized corpora the fuzzer grew
//! (`corpus/TARGET/`) and the inputs that once failed (`regressions/TARGET/`, each a test
//! that failed before its fix). Each target's seeds run too, so a target's properties are
//! checked even before it has a corpus.

use std::path::Path;

fn inputs(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, Vec<u8>)> = entries
        .map(|e| e.expect("a readable corpus directory").path())
        .filter(|p| p.is_file())
        .map(|p| {
            (
                p.display().to_string(),
                std::fs::read(&p).expect("a readable input"),
            )
        })
        .collect();
    out.sort();
    out
}

/// Names the input being replayed if it fails.
struct Naming<'a>(&'a str);

impl Drop for Naming<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!("failing input: {}", self.0);
        }
    }
}

#[test]
fn every_committed_input_holds() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for target in gpuio_fuzz::TARGETS {
        let corpus = inputs(&root.join("corpus").join(target.name));
        assert!(
            !corpus.is_empty(),
            "{}: no committed corpus (cargo xtask fuzz {} grows one)",
            target.name,
            target.name
        );
        let regressions = inputs(&root.join("regressions").join(target.name));
        let seeds = (target.seeds)();
        assert!(!seeds.is_empty(), "{}: no seeds", target.name);
        for (name, input) in corpus.iter().chain(&regressions) {
            let _naming = Naming(name);
            gpuio_fuzz::run(target, input);
        }
        for seed in &seeds {
            gpuio_fuzz::run(target, seed);
        }
    }
}
