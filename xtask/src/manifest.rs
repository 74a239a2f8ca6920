//! Kernel manifests: each crate that carries kernels lists its modules in `kernels.toml` (the
//! module's name, what it does, the source files it is put together from, its functions). A
//! source is a file of the crate's `kernels` directory or, failing that, of the workspace's
//! public device headers (`headers`: `kernels/` at the root, what user kernels include).
//! `ptx --write` builds each module's PTX into the crate's `ptx/` and writes the Rust that
//! embeds it: a `KernelSource` static per module and an enum naming its functions, so that
//! code launches a kernel by name, never by position. `ptx --check` and this module's test
//! fail where the committed Rust is not what the manifest gives.

use crate::{Result, root};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The file name of a crate's manifest.
const MANIFEST: &str = "kernels.toml";

/// One crate's kernels.
pub struct Manifest {
    /// The crate's directory.
    pub dir: PathBuf,
    /// Where the crate's sources live.
    kernels: PathBuf,
    /// Where the public device headers live.
    headers: PathBuf,
    /// The generated Rust file, relative to `dir`.
    rust: String,
    pub modules: Vec<Module>,
}

/// One module: what is compiled together and loaded as one.
pub struct Module {
    /// `gather`: the PTX files are `gather.compute_<arch>.ptx`, the static `GATHER`, the
    /// enum `GatherKernel`.
    pub name: String,
    doc: String,
    /// Files of the kernels directory whose text, in this order, is the module's source.
    pub sources: Vec<String>,
    functions: Vec<String>,
}

impl Module {
    /// The name gpuio logs and the PTX's first line record (`gather.cu`).
    pub fn file_name(&self) -> String {
        format!("{}.cu", self.name)
    }
}

impl Manifest {
    /// The crate's package name (its directory's).
    pub fn crate_name(&self) -> String {
        self.dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// Where the crate's device code (PTX, cubins and their stamps) lives.
    pub fn ptx_dir(&self) -> PathBuf {
        self.dir.join("ptx")
    }

    /// The device code directory relative to the workspace root, for messages.
    pub fn ptx_dir_shown(&self) -> String {
        let dir = self.ptx_dir();
        dir.strip_prefix(root())
            .unwrap_or(&dir)
            .display()
            .to_string()
    }

    fn rust_path(&self) -> PathBuf {
        self.dir.join(&self.rust)
    }

    /// Where a module's source file is: the crate's `kernels`, else the public headers.
    pub fn source(&self, name: &str) -> Result<PathBuf> {
        [&self.kernels, &self.headers]
            .iter()
            .map(|d| d.join(name))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                format!(
                    "{}: no source {name} in {} or {}",
                    self.dir.display(),
                    self.kernels.display(),
                    self.headers.display()
                )
            })
    }

    /// A source's path relative to the workspace root, as messages and PTX headers name it.
    pub fn source_shown(&self, name: &str) -> Result<String> {
        let path = self.source(name)?;
        Ok(normalize(&path)
            .strip_prefix(normalize(&root()))
            .map_or_else(|_| path.display().to_string(), |p| p.display().to_string()))
    }
}

/// `path` without `.` and `..` components (no file system access).
fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// `to` relative to the directory `from` (both absolute, or both relative to one place).
fn relative(from: &Path, to: &Path) -> PathBuf {
    let (from, to) = (normalize(from), normalize(to));
    let common = from
        .components()
        .zip(to.components())
        .take_while(|(a, b)| a == b)
        .count();
    let mut out = PathBuf::new();
    for _ in from.components().skip(common) {
        out.push("..");
    }
    for c in to.components().skip(common) {
        out.push(c);
    }
    out
}

/// Every crate's manifest (`crates/*/kernels.toml`), by crate directory.
pub fn all() -> Result<Vec<Manifest>> {
    let crates = root().join("crates");
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&crates)
        .map_err(|e| format!("{}: {e}", crates.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|d| d.join(MANIFEST).is_file())
        .collect();
    dirs.sort();
    if dirs.is_empty() {
        return Err(format!(
            "no crate under {} has a {MANIFEST}",
            crates.display()
        ));
    }
    dirs.iter().map(|d| parse(d)).collect()
}

fn parse(dir: &Path) -> Result<Manifest> {
    let path = dir.join(MANIFEST);
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(&path).map_err(|e| format!("{shown}: {e}"))?;
    let table: toml::Table = text.parse().map_err(|e| format!("{shown}: {e}"))?;
    let string = |t: &toml::Table, key: &str| -> Result<String> {
        t.get(key)
            .and_then(|v| v.as_str())
            .map(str::to_owned)
            .ok_or_else(|| format!("{shown}: `{key}` must be a string"))
    };
    let strings = |t: &toml::Table, key: &str| -> Result<Vec<String>> {
        let list = t.get(key).and_then(|v| v.as_array());
        let items: Option<Vec<String>> =
            list.and_then(|l| l.iter().map(|v| v.as_str().map(str::to_owned)).collect());
        items
            .filter(|l| !l.is_empty())
            .ok_or_else(|| format!("{shown}: `{key}` must be a list of strings"))
    };
    let kernels = dir.join(string(&table, "kernels")?);
    let headers = dir.join(string(&table, "headers")?);
    let rust = string(&table, "rust")?;
    let list = table
        .get("module")
        .and_then(|v| v.as_array())
        .ok_or_else(|| format!("{shown}: no [[module]]"))?;
    let mut modules = Vec::new();
    for m in list {
        let m = m
            .as_table()
            .ok_or_else(|| format!("{shown}: a [[module]] is not a table"))?;
        let module = Module {
            name: string(m, "name")?,
            doc: string(m, "doc")?,
            sources: strings(m, "sources")?,
            functions: strings(m, "functions")?,
        };
        if !is_identifier(&module.name) {
            return Err(format!(
                "{shown}: module name {:?} is not a lower-case identifier",
                module.name
            ));
        }
        modules.push(module);
    }
    Ok(Manifest {
        dir: dir.to_path_buf(),
        kernels,
        headers,
        rust,
        modules,
    })
}

fn is_identifier(s: &str) -> bool {
    s.starts_with(|c: char| c.is_ascii_lowercase())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_')
}

/// `gpuio_gather_16` → `Gather16`: a function's variant in its module's enum.
fn variant(function: &str) -> String {
    camel(function.strip_prefix("gpuio_").unwrap_or(function))
}

fn camel(snake: &str) -> String {
    snake
        .split('_')
        .filter(|w| !w.is_empty())
        .map(|w| {
            let mut c = w.chars();
            c.next()
                .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                .unwrap_or_default()
        })
        .collect()
}

/// The Rust that embeds `m`'s modules, as `ptx --write` writes it.
pub fn rust(m: &Manifest) -> Result<String> {
    let archs = arch_numbers(crate::ptx::PTX_ARCHS, "compute_");
    let cubin_archs = arch_numbers(crate::ptx::CUBIN_ARCHS, "sm_");
    // include_str! resolves paths from the generated file's directory.
    let here = m
        .rust_path()
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default();
    let up = relative(&here, &m.dir).display().to_string() + "/";
    let hal = if m.dir.ends_with("gpuio-hal") {
        "crate::kernels"
    } else {
        "gpuio_hal::kernels"
    };
    let mut out = String::new();
    let w = &mut out;
    let _ = writeln!(
        w,
        "// Generated by `cargo xtask ptx --write` from kernels.toml; do not edit.\n\n\
         //! The kernel modules of this crate's `kernels.toml`: a static per module, and an\n\
         //! enum per module naming its functions.\n\n\
         use {hal}::{{EmbeddedCubin, EmbeddedPtx, Kernel, KernelSource}};"
    );
    for module in &m.modules {
        let stat = module.name.to_ascii_uppercase();
        let kind = format!("{}Kernel", camel(&module.name));
        let _ = writeln!(w);
        for line in module.doc.trim().lines() {
            let _ = writeln!(w, "/// {}", line.trim_end());
        }
        let _ = writeln!(
            w,
            "pub static {stat}: KernelSource = KernelSource {{\n    name: {:?},\n    source: concat!(",
            module.file_name()
        );
        for s in &module.sources {
            let path = relative(&here, &m.source(s)?);
            let _ = writeln!(w, "        include_str!(\"{}\"),", path.display());
        }
        let _ = writeln!(w, "    ),\n    functions: &[");
        for f in &module.functions {
            let _ = writeln!(w, "        {f:?},");
        }
        let _ = writeln!(w, "    ],\n    ptx: &[");
        for arch in &archs {
            let _ = writeln!(
                w,
                "        EmbeddedPtx {{\n            arch: {arch},\n            text: include_str!(\"{up}ptx/{}.compute_{arch}.ptx\"),\n        }},",
                module.name
            );
        }
        let _ = writeln!(w, "    ],\n    cubins: &[");
        for arch in &cubin_archs {
            let _ = writeln!(
                w,
                "        EmbeddedCubin {{\n            arch: {arch},\n            image: include_bytes!(\"{up}ptx/{0}.sm_{arch}.cubin\"),\n            stamp: include_str!(\"{up}ptx/{0}.sm_{arch}.stamp\"),\n        }},",
                module.name
            );
        }
        let _ = writeln!(w, "    ],\n}};");
        let _ = writeln!(
            w,
            "\n/// The functions of [`{stat}`], by name.\n\
             #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]\npub enum {kind} {{"
        );
        let mut seen = Vec::new();
        for f in &module.functions {
            let v = variant(f);
            if seen.contains(&v) {
                return Err(format!("{}: two functions are named {v}", module.name));
            }
            let _ = writeln!(w, "    /// `{f}`\n    {v},");
            seen.push(v);
        }
        let _ = writeln!(
            w,
            "}}\n\nimpl Kernel for {kind} {{\n    fn module() -> &'static KernelSource {{\n        \
             &{stat}\n    }}\n\n    fn index(self) -> usize {{\n        self as usize\n    }}\n}}"
        );
    }
    let list: Vec<String> = m
        .modules
        .iter()
        .map(|module| format!("&{}", module.name.to_ascii_uppercase()))
        .collect();
    let _ = writeln!(
        w,
        "\n/// Every module of this crate's `kernels.toml`.\n\
         pub static MODULES: &[&KernelSource] = &[{}];",
        list.join(", ")
    );
    Ok(out)
}

/// Architectures as numbers, without their `prefix` (`compute_80` → 80, `sm_90` → 90).
fn arch_numbers(archs: &[&str], prefix: &str) -> Vec<u32> {
    archs
        .iter()
        .filter_map(|a| a.strip_prefix(prefix)?.parse().ok())
        .collect()
}

/// Writes each manifest's Rust where it differs; how many files changed.
pub fn write_rust() -> Result<usize> {
    let mut changed = 0;
    for m in all()? {
        let text = rust(&m)?;
        let path = m.rust_path();
        if std::fs::read_to_string(&path).ok().as_deref() != Some(text.as_str()) {
            std::fs::write(&path, &text).map_err(|e| format!("{}: {e}", path.display()))?;
            eprintln!("wrote {}", path.display());
            changed += 1;
        }
    }
    Ok(changed)
}

/// Each manifest whose committed Rust is not what it gives.
pub fn stale_rust() -> Result<Vec<String>> {
    let mut stale = Vec::new();
    for m in all()? {
        let path = m.rust_path();
        if std::fs::read_to_string(&path).ok() != Some(rust(&m)?) {
            stale.push(format!(
                "{} is not what {} gives (run `cargo xtask ptx --wheels --write`)",
                path.display(),
                m.dir.join(MANIFEST).display()
            ));
        }
    }
    Ok(stale)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn function_names_become_variants() {
        assert_eq!(variant("gpuio_gather_16"), "Gather16");
        assert_eq!(variant("gpuio_order_scan_blocks"), "OrderScanBlocks");
        assert_eq!(camel("ring_bench"), "RingBench");
    }

    #[test]
    fn the_generated_kernel_modules_are_current() {
        let stale = stale_rust().unwrap();
        assert!(stale.is_empty(), "{}", stale.join("\n"));
    }

    #[test]
    fn every_source_a_manifest_names_exists() {
        for m in all().unwrap() {
            for module in &m.modules {
                for s in &module.sources {
                    m.source(s).unwrap();
                }
            }
        }
    }

    #[test]
    fn relative_paths_climb_to_the_common_directory() {
        let p = |s: &str| PathBuf::from(s);
        assert_eq!(
            relative(&p("/w/crates/a/src"), &p("/w/kernels/x.cuh")),
            p("../../../kernels/x.cuh")
        );
        assert_eq!(
            relative(&p("/w/crates/a/src/k"), &p("/w/crates/a/ptx/m.ptx")),
            p("../../ptx/m.ptx")
        );
        assert_eq!(
            relative(&p("/w/crates/a/src/../src"), &p("/w/crates/a/kernels")),
            p("../kernels")
        );
    }
}
