//! The invariants of docs/ARCHITECTURE.md, checked: dependencies point strictly downward and
//! transports never import each other; test support (gpuio-testkit) is only ever a
//! dev-dependency; each crate's integration tests are one binary (`tests/it/`), any other
//! saying why it needs a process of its own; `unsafe` lives only in the device layer (gpuio-hal,
//! gpuio-ring, gpuio-nvme, gpuio-rdma, gpuio-nixl), the C ABIs (gpuio-capi, gpuio-cufile) and the one module of the
//! Python binding that borrows Python's buffers, each block with a `// SAFETY:` note (clippy's
//! `undocumented_unsafe_blocks`, which every crate inherits from the workspace); every other
//! crate forbids unsafe code; the HAL's `gpu/` names no feature (its device work is ops);
//! every crate has a README. And
//! the docs' references hold: every `docs/<path>.md` (and `docs/<path>.md#<anchor>`) named in
//! a tracked source or doc file exists (and has that heading), and nothing cites design
//! documents that are not in the repository: the design vocabulary is docs/REFERENCE.md.

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
        "gpuio-ring" | "gpuio-nvme" | "gpuio-staging" | "gpuio-rdma" | "gpuio-nixl"
        | "gpuio-ai-device" => 1,
        "gpuio-transport-memio" | "gpuio-transport-localio" | "gpuio-transport-remoteio" => 2,
        "gpuio-core" => 3,
        "gpuio-api" => 4,
        "gpuio-ai" | "gpuio-cufile" => 5,
        "gpuio-bench" | "gpuio-py" | "gpuio-capi" => 6,
        "gpuio-cli" => 7,
        _ => return None,
    })
}

/// Crates that only tests use: no layer, taken only as a dev-dependency, never published, and
/// depending on no gpuio crate (so that every crate, gpuio-hal included, can use them).
const DEV_ONLY: &[&str] = &["gpuio-testkit"];

fn crates() -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    for dir in std::fs::read_dir(root().join("crates")).unwrap() {
        let dir = dir.unwrap().path();
        out.push((dir.file_name().unwrap().to_string_lossy().into_owned(), dir));
    }
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
        let deps = manifest
            .get("dependencies")
            .and_then(|d| d.as_table())
            .cloned()
            .unwrap_or_default();
        if DEV_ONLY.contains(&name.as_str()) {
            let ours: Vec<_> = deps.keys().filter(|d| d.starts_with("gpuio-")).collect();
            assert!(ours.is_empty(), "{name} (dev-only) depends on {ours:?}");
            continue;
        }
        let me = layer(&name).unwrap_or_else(|| panic!("{name} has no layer in this test"));
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

/// The dependency tables of a manifest that reach a build of the crate itself: `[dependencies]`
/// and `[build-dependencies]`, also under `[target.'<cfg>']`, with the table's name.
fn normal_dependency_tables(manifest: &toml::Table) -> Vec<(String, toml::Table)> {
    let mut out = Vec::new();
    let mut take = |prefix: &str, t: &toml::Table| {
        for key in ["dependencies", "build-dependencies", "build_dependencies"] {
            if let Some(deps) = t.get(key).and_then(|d| d.as_table()) {
                out.push((format!("{prefix}{key}"), deps.clone()));
            }
        }
    };
    take("", manifest);
    if let Some(targets) = manifest.get("target").and_then(|t| t.as_table()) {
        for (cfg, t) in targets {
            if let Some(t) = t.as_table() {
                take(&format!("target.{cfg}."), t);
            }
        }
    }
    out
}

#[test]
fn dev_only_crates_are_only_dev_dependencies() {
    let mut manifests: Vec<(String, PathBuf)> = crates();
    manifests.push(("gpuio-tests".into(), root().join("tests")));
    manifests.push(("xtask".into(), root().join("xtask")));
    manifests.push(("gpuio-fuzz".into(), root().join("fuzz")));
    let mut used = Vec::new();
    for (name, dir) in manifests {
        let manifest: toml::Table =
            toml::from_str(&std::fs::read_to_string(dir.join("Cargo.toml")).unwrap()).unwrap();
        if DEV_ONLY.contains(&name.as_str()) {
            let publish = manifest["package"].get("publish");
            assert_eq!(
                publish.and_then(|p| p.as_bool()),
                Some(false),
                "{name} must say `publish = false` itself"
            );
        }
        for (table, deps) in normal_dependency_tables(&manifest) {
            for dev_only in DEV_ONLY {
                assert!(
                    !deps.contains_key(*dev_only),
                    "{name} has {dev_only} in [{table}]: it is test support, a dev-dependency only"
                );
            }
        }
        let dev = manifest
            .get("dev-dependencies")
            .and_then(|d| d.as_table())
            .cloned()
            .unwrap_or_default();
        used.extend(
            DEV_ONLY
                .iter()
                .filter(|d| dev.contains_key(**d))
                .map(|d| (name.clone(), *d)),
        );
    }
    for dev_only in DEV_ONLY {
        assert!(
            used.iter().any(|(_, d)| d == dev_only),
            "no crate uses {dev_only}: is the scan broken?"
        );
    }
}

/// Crates with unsafe code: the device layer — the HAL (FFI to the drivers and the OS, behind
/// safe types) and the device-family crates (memory shared with a device, their kernels'
/// launches, FFI to libibverbs and NIXL) — and the C ABIs, gpuio's and cuFile's (raw pointers from C
/// callers, turned into references at one call site each).
const UNSAFE_CRATES: &[&str] = &[
    "gpuio-hal",
    "gpuio-ring",
    "gpuio-nvme",
    "gpuio-rdma",
    "gpuio-nixl",
    "gpuio-ai-device",
    "gpuio-capi",
    "gpuio-cufile",
];

/// Crates that deny unsafe code but for one module, where it is allowed: the Python binding's
/// `lent.rs` turns a buffer Python lends (held through the buffer protocol) into a slice.
const UNSAFE_MODULES: &[(&str, &str)] = &[("gpuio-py", "src/lent.rs")];

#[test]
fn unsafe_code_lives_only_in_the_device_layer_and_the_c_abi() {
    for (name, dir) in crates() {
        let mut files = Vec::new();
        rust_files(&dir, &mut files);
        let lib = ["src/lib.rs", "src/main.rs"]
            .iter()
            .map(|f| dir.join(f))
            .find(|p| p.exists())
            .unwrap();
        let lib_text = std::fs::read_to_string(&lib).unwrap();
        let module = UNSAFE_MODULES.iter().find(|(c, _)| *c == name).map(|m| m.1);
        if let Some(module) = module {
            assert!(
                lib_text.contains("#![deny(unsafe_code)]"),
                "{name} must deny unsafe code outside {module}"
            );
            let text = std::fs::read_to_string(dir.join(module)).unwrap();
            assert!(
                text.contains("#![allow(unsafe_code)]") && text.contains("unsafe {"),
                "{name}'s {module} is where its unsafe code is: is the list stale?"
            );
        } else if !UNSAFE_CRATES.contains(&name.as_str()) {
            assert!(
                lib_text.contains("#![forbid(unsafe_code)]"),
                "{name} must forbid unsafe code"
            );
        } else if name != "gpuio-hal" {
            assert!(
                lib_text.contains("#![deny(unsafe_op_in_unsafe_fn)]"),
                "{name} must mark every unsafe operation, also inside unsafe functions"
            );
        }
        // The allowed crates' notes are clippy's to check (below); the rest must have none,
        // tests included (they are not under the crate's `forbid`).
        if UNSAFE_CRATES.contains(&name.as_str()) {
            continue;
        }
        for f in files {
            if module.is_some_and(|m| f == dir.join(m)) {
                continue;
            }
            let text = std::fs::read_to_string(&f).unwrap();
            for (i, line) in text.lines().enumerate() {
                let code = line.split("//").next().unwrap_or("");
                assert!(
                    !(code.contains("unsafe {") || code.contains("unsafe impl")),
                    "unsafe outside {UNSAFE_CRATES:?}: {}:{}",
                    f.display(),
                    i + 1
                );
            }
        }
    }
}

/// Every `unsafe` block and impl has its `// SAFETY:` note: clippy's
/// `undocumented_unsafe_blocks`, denied for the workspace, which every crate inherits.
#[test]
fn every_crate_inherits_the_workspace_lints() {
    let workspace = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    assert!(
        workspace.contains("undocumented_unsafe_blocks = \"deny\""),
        "the workspace must deny clippy::undocumented_unsafe_blocks"
    );
    let mut manifests: Vec<PathBuf> = crates().into_iter().map(|(_, d)| d).collect();
    manifests.extend([
        root().join("tests"),
        root().join("xtask"),
        root().join("fuzz"),
    ]);
    for dir in manifests {
        let manifest = std::fs::read_to_string(dir.join("Cargo.toml")).unwrap();
        let lints = manifest
            .split("\n[")
            .find(|section| section.starts_with("lints]"));
        assert!(
            lints.is_some_and(|l| l.lines().any(|line| line.trim() == "workspace = true")),
            "{} must inherit the workspace lints ([lints] workspace = true)",
            dir.display()
        );
    }
}

/// The phrase a test file outside `tests/it/` must have in its leading `//!` docs, with the
/// reason it needs a process of its own.
const OWN_BINARY: &str = "binary of its own";

#[test]
fn each_crate_has_one_test_binary_and_says_why_of_any_other() {
    let mut problems = Vec::new();
    for (name, dir) in crates() {
        let Ok(entries) = std::fs::read_dir(dir.join("tests")) else {
            continue;
        };
        for entry in entries {
            let path = entry.unwrap().path();
            let file = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                if file != "it" || !path.join("main.rs").exists() {
                    problems.push(format!(
                        "{name}: tests/{file}/ is not tests/it/ with a main.rs: its files \
                         belong in tests/it/"
                    ));
                }
            } else if file.ends_with(".rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                let docs: Vec<&str> = text.lines().take_while(|l| l.starts_with("//!")).collect();
                if !docs.join(" ").contains(OWN_BINARY) {
                    let module = file.trim_end_matches(".rs");
                    problems.push(format!(
                        "{name}: tests/{file} is a test binary of its own: move it to \
                         tests/it/{file} (with `mod {module};` in tests/it/main.rs), or say at \
                         its top why it needs a process of its own (\"a test {OWN_BINARY}: \
                         ...\")"
                    ));
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The HAL's GPU layer is generic: features describe their device work as ops (`DeviceOp`)
/// in their own folders or crates, so `gpu/` names none of them. (The request ring, the
/// on-demand arrays and NVMe are crates above the HAL, which it cannot name at all.)
#[test]
fn the_gpu_layer_names_no_feature() {
    let mut files = Vec::new();
    rust_files(&root().join("crates/gpuio-hal/src/gpu"), &mut files);
    assert!(
        files.len() > 10,
        "no gpu/ sources found: is the scan broken?"
    );
    let mut problems = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file).unwrap();
        for (n, line) in text.lines().enumerate() {
            let code = line.split("//").next().unwrap_or("");
            // A path segment, not the end of a longer name (`String::`).
            let names = |f: &str| {
                code.match_indices(f).any(|(at, _)| {
                    !code[..at]
                        .chars()
                        .next_back()
                        .is_some_and(|c| c.is_alphanumeric() || c == '_')
                })
            };
            if [
                "crate::ai",
                "ring::",
                "ondemand::",
                "nvme::",
                "gpuio_ring",
                "gpuio_nvme",
            ]
            .iter()
            .any(|f| names(f))
            {
                problems.push(format!("{}:{}: {}", file.display(), n + 1, line.trim()));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "gpu/ names a feature:\n{}",
        problems.join("\n")
    );
}

#[test]
fn every_crate_has_a_readme() {
    for (name, dir) in crates() {
        assert!(dir.join("README.md").exists(), "{name} has no README.md");
    }
    for doc in ["README.md", "docs/ARCHITECTURE.md", "docs/REFERENCE.md"] {
        assert!(root().join(doc).exists(), "{doc} is missing");
    }
}

/// The extensions of the source and documentation files the reference checks read.
const DOC_AND_SOURCE: &[&str] = &["rs", "md", "toml", "cu", "cuh", "sh"];

/// The tracked source and documentation files, as paths relative to the root: what
/// `git ls-files` lists, or where git cannot answer (a tree without `.git`), every such file
/// outside `target` and hidden folders.
fn tracked_files() -> Vec<String> {
    let wanted = |p: &str| {
        Path::new(p)
            .extension()
            .is_some_and(|x| DOC_AND_SOURCE.iter().any(|e| x == *e))
    };
    let git = std::process::Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root())
        .output();
    if let Ok(out) = git
        && out.status.success()
        && !out.stdout.is_empty()
    {
        return String::from_utf8_lossy(&out.stdout)
            .split('\0')
            .filter(|p| wanted(p) && root().join(p).is_file())
            .map(str::to_owned)
            .collect();
    }
    fn walk(dir: &Path, rel: &str, out: &mut Vec<String>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            let rel = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            if e.file_type().unwrap().is_dir() {
                if !name.starts_with('.') && name != "target" {
                    walk(&e.path(), &rel, out);
                }
            } else {
                out.push(rel);
            }
        }
    }
    let mut out = Vec::new();
    walk(&root(), "", &mut out);
    out.retain(|p| wanted(p));
    out
}

/// GitHub's anchor of a Markdown heading: lower case, spaces to `-`, every other character
/// but letters, digits, `-` and `_` dropped.
fn anchor_of(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown text's headings (outside code blocks), a repeated one numbered
/// as GitHub does (`x`, `x-1`, ...).
fn anchors(markdown: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut in_code = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if in_code || !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = anchor_of(line[hashes..].trim_end_matches('#'));
        let mut anchor = base.clone();
        let mut n = 0;
        while out.contains(&anchor) {
            n += 1;
            anchor = format!("{base}-{n}");
        }
        out.push(anchor);
    }
    out
}

/// The `docs/<path>.md` and `docs/<path>.md#<anchor>` references in a text, with their line
/// numbers; an anchor is `None` where there is none.
fn doc_references(text: &str) -> Vec<(usize, String, Option<String>)> {
    let path_char = |c: char| c.is_ascii_alphanumeric() || "_./-".contains(c);
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        for (at, _) in line.match_indices("docs/") {
            if line[..at].chars().next_back().is_some_and(path_char) {
                continue; // part of a longer path: not relative to the root
            }
            let run: String = line[at..].chars().take_while(|&c| path_char(c)).collect();
            let path = run.trim_end_matches('.');
            if !path.ends_with(".md") {
                continue;
            }
            let after = &line[at + run.len()..];
            let anchor = (path.len() == run.len())
                .then(|| after.strip_prefix('#'))
                .flatten()
                .map(|a| {
                    a.chars()
                        .take_while(|&c| c.is_alphanumeric() || c == '-' || c == '_')
                        .collect::<String>()
                })
                .filter(|a| !a.is_empty());
            out.push((i + 1, path.to_owned(), anchor));
        }
    }
    out
}

#[test]
fn references_to_docs_resolve() {
    let files = tracked_files();
    assert!(
        files.len() > 50,
        "found only {} source and doc files",
        files.len()
    );
    let mut headings: BTreeMap<String, Option<Vec<String>>> = BTreeMap::new();
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in &files {
        let text = std::fs::read_to_string(root().join(file)).unwrap();
        let mut refs = doc_references(&text);
        if file.ends_with(".md") {
            // Links to a heading of the same page: [text](#anchor).
            for (i, line) in text.lines().enumerate() {
                for (at, _) in line.match_indices("](#") {
                    let anchor: String = line[at + 3..].chars().take_while(|&c| c != ')').collect();
                    refs.push((i + 1, file.clone(), Some(anchor)));
                }
            }
        }
        for (line, path, anchor) in refs {
            checked += 1;
            let known = headings.entry(path.clone()).or_insert_with(|| {
                std::fs::read_to_string(root().join(&path))
                    .ok()
                    .map(|t| anchors(&t))
            });
            match (known, anchor) {
                (None, _) => problems.push(format!("{file}:{line}: {path} does not exist")),
                (Some(known), Some(a)) if !known.contains(&a) => {
                    problems.push(format!("{file}:{line}: {path} has no heading #{a}"))
                }
                _ => {}
            }
        }
    }
    assert!(
        checked > 0,
        "no references to docs/ found: is the scan broken?"
    );
    assert!(
        problems.is_empty(),
        "dangling references:\n{}",
        problems.join("\n")
    );
}

#[test]
fn no_citations_of_documents_outside_the_repository() {
    // Spelled in pieces, so that this file does not cite what it forbids.
    let words = [concat!("S", "AD"), concat!("S", "DD")];
    let strings = [concat!("DESIGN", ".md"), concat!("docs/", "GPU.md")];
    let word_at = |line: &str, at: usize, len: usize| {
        let edge = |c: Option<char>| !c.is_some_and(|c| c.is_alphanumeric() || c == '_');
        edge(line[..at].chars().next_back()) && edge(line[at + len..].chars().next())
    };
    let mut problems = Vec::new();
    for file in tracked_files() {
        let text = std::fs::read_to_string(root().join(&file)).unwrap();
        for (i, line) in text.lines().enumerate() {
            let word = words.iter().find(|w| {
                line.match_indices(**w)
                    .any(|(at, _)| word_at(line, at, w.len()))
            });
            if let Some(found) = word.or_else(|| strings.iter().find(|s| line.contains(**s))) {
                problems.push(format!(
                    "{file}:{}: {found}: cite docs/REFERENCE.md#<anchor> instead",
                    i + 1
                ));
            }
        }
    }
    assert!(
        problems.is_empty(),
        "citations of documents that are not in the repository:\n{}",
        problems.join("\n")
    );
}
