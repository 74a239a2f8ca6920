//! The invariants of docs/ARCHITECTURE.md, checked: dependencies point strictly downward and
//! transports never import each other; `unsafe` lives only in gpuio-hal, each block with a
//! `// SAFETY:` note; every other crate forbids unsafe code; every crate has a README.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

/// Layer of each crate: a crate may depend only on crates of a strictly lower layer.
fn layer(name: &str) -> Option<u32> {
    Some(match name {
        "gpuio-hal" => 0,
        "gpuio-transport-memio" | "gpuio-transport-localio" | "gpuio-transport-remoteio" => 1,
        "gpuio-core" => 2,
        "gpuio-api" => 3,
        "gpuio-ai" | "gpuio-bench" => 4,
        "gpuio-cli" => 5,
        _ => return None,
    })
}

fn crates() -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    for dir in std::fs::read_dir(root().join("crates")).unwrap() {
        let dir = dir.unwrap().path();
        out.push((dir.file_name().unwrap().to_string_lossy().into_owned(), dir));
    }
    out.push(("gpuio-bench".into(), root().join("benches")));
    out.sort();
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn dependencies_point_strictly_downward() {
    let mut edges = BTreeMap::new();
    for (name, dir) in crates() {
        let manifest: toml::Table =
            toml::from_str(&std::fs::read_to_string(dir.join("Cargo.toml")).unwrap()).unwrap();
        let me = layer(&name).unwrap_or_else(|| panic!("{name} has no layer in this test"));
        let deps = manifest
            .get("dependencies")
            .and_then(|d| d.as_table())
            .cloned()
            .unwrap_or_default();
        for dep in deps.keys().filter(|d| d.starts_with("gpuio-")) {
            let theirs = layer(dep).unwrap_or_else(|| panic!("{dep} has no layer"));
            assert!(
                theirs < me,
                "{name} (layer {me}) depends on {dep} (layer {theirs})"
            );
            edges.insert(format!("{name} -> {dep}"), ());
        }
    }
    assert!(edges.contains_key("gpuio-core -> gpuio-transport-memio"));
}

#[test]
fn unsafe_code_lives_only_in_the_hal_with_safety_notes() {
    for (name, dir) in crates() {
        let mut files = Vec::new();
        rust_files(&dir, &mut files);
        let lib = ["src/lib.rs", "src/main.rs"]
            .iter()
            .map(|f| dir.join(f))
            .find(|p| p.exists())
            .unwrap();
        let lib_text = std::fs::read_to_string(&lib).unwrap();
        if name != "gpuio-hal" {
            assert!(
                lib_text.contains("#![forbid(unsafe_code)]"),
                "{name} must forbid unsafe code"
            );
        }
        for f in files {
            let text = std::fs::read_to_string(&f).unwrap();
            let lines: Vec<&str> = text.lines().collect();
            for (i, line) in lines.iter().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                let is_block = code.contains("unsafe {") || code.contains("unsafe impl");
                if !is_block {
                    continue;
                }
                assert_eq!(
                    name,
                    "gpuio-hal",
                    "unsafe outside gpuio-hal: {}:{}",
                    f.display(),
                    i + 1
                );
                let noted = lines[i.saturating_sub(6)..=i]
                    .iter()
                    .any(|l| l.contains("SAFETY:"));
                assert!(
                    noted,
                    "unsafe without a SAFETY note at {}:{}",
                    f.display(),
                    i + 1
                );
            }
        }
    }
}

#[test]
fn every_crate_has_a_readme() {
    for (name, dir) in crates() {
        assert!(dir.join("README.md").exists(), "{name} has no README.md");
    }
    for doc in ["README.md", "docs/ARCHITECTURE.md"] {
        assert!(root().join(doc).exists(), "{doc} is missing");
    }
}
