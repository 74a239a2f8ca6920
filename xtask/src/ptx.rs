//! `cargo xtask ptx`: every kernel module compiled for every target architecture by nvcc (to
//! cubin: the front end and ptxas), and a user kernel over the public device header. With
//! `--wheels` (CI) it also runs each crate's `kernels` test, which compiles the sources gpuio
//! embeds with NVRTC as gpuio does where no embedded PTX fits; on the GPU machine that test
//! runs with the others. No GPU is
//! needed to compile, so CI runs it with CUDA 13.0's compilers from PyPI.
//!
//! The embedded device code (`crates/<crate>/ptx/`: `<module>.compute_XX.ptx`, which the
//! driver JIT-compiles, and `<module>.sm_XX.cubin` with its `.stamp`, which it loads as it
//! is) is built here too: `--write` (re)writes it from the sources, and `--check` (CI) builds
//! it afresh in a temporary directory, twice, and fails naming every committed file that
//! differs. Both need nvcc 13.0.88 (`--wheels`): the files are that compiler's output.
//!
//! Which modules there are, and what they are made of, each crate's `kernels.toml` says
//! ([`manifest`]); `--write` also writes the Rust that embeds them, `--rust` only that.

use crate::manifest::{self, Manifest};
use crate::{Result, cargo, has, root, run, run_tests};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The architectures every kernel must build for: Ampere, Hopper, Blackwell.
const ARCHS: &[&str] = &["sm_80", "sm_90", "sm_100"];

/// CUDA 13.0's compilers as PyPI wheels (the GPU machine's toolkit version), pinned so that
/// CI checks what the GPU machine compiles. nvcc needs nvvm (cicc), crt and the runtime's
/// headers beside it.
const WHEELS: &[&str] = &[
    "nvidia-cuda-nvcc==13.0.88",
    "nvidia-nvvm==13.0.88",
    "nvidia-cuda-crt==13.0.88",
    "nvidia-cuda-runtime==13.0.96",
    "nvidia-cuda-nvrtc==13.0.88",
];

/// Set in the child that runs with the wheels' libraries on its loader path.
const WHEELS_ENV: &str = "GPUIO_XTASK_CUDA_WHEELS";

/// The virtual architectures of the embedded PTX (`gpuio_hal::kernels::PTX_ARCHS`, which says
/// why these).
pub const PTX_ARCHS: &[&str] = &["compute_80", "compute_100"];

/// The real architectures of the embedded machine code (`gpuio_hal::kernels::CUBIN_ARCHS`).
pub const CUBIN_ARCHS: &[&str] = &["sm_90", "sm_100"];

/// The nvcc whose output the committed PTX is (what `--wheels` installs).
const NVCC_VERSION: &str = "V13.0.88";

struct Options {
    archs: Vec<String>,
    /// Install the compilers from PyPI where missing, and fail if either is still missing.
    wheels: bool,
    /// Only (re)write the embedded device code.
    write: bool,
    /// Also check the embedded device code against a fresh build.
    check: bool,
    /// Only (re)write the Rust that embeds the modules (no compiler needed).
    rust: bool,
}

fn parse(args: &[String]) -> Result<Options> {
    let mut opts = Options {
        archs: Vec::new(),
        wheels: false,
        write: false,
        check: false,
        rust: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--arch" => opts
                .archs
                .push(it.next().ok_or("--arch needs e.g. sm_90")?.clone()),
            "--wheels" => opts.wheels = true,
            "--write" => opts.write = true,
            "--check" => opts.check = true,
            "--rust" => opts.rust = true,
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if opts.write && opts.check {
        return Err("--write and --check exclude each other".into());
    }
    if opts.archs.is_empty() {
        opts.archs = ARCHS.iter().map(|a| a.to_string()).collect();
    }
    if let Some(bad) = opts.archs.iter().find(|a| arch_number(a).is_none()) {
        return Err(format!("--arch {bad}: expected sm_<number>, e.g. sm_90"));
    }
    Ok(opts)
}

fn arch_number(arch: &str) -> Option<&str> {
    arch.strip_prefix("sm_")
        .filter(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
}

/// Compiles every kernel for every architecture with every compiler present; fails if one
/// rejects a source, and (with `--wheels`) if a compiler could not be had. With `--write`,
/// only writes the embedded PTX; with `--check`, also fails if it is stale.
pub fn ptx(args: &[String]) -> Result {
    let opts = parse(args)?;
    if opts.rust {
        let changed = manifest::write_rust()?;
        eprintln!("kernel module Rust: {changed} files changed");
        return Ok(());
    }
    if opts.wheels && std::env::var_os(WHEELS_ENV).is_none() {
        return rerun_with_wheels(args);
    }
    if opts.write {
        return write_ptx();
    }
    let mut failed = Vec::new();
    if has("nvcc", "--version") {
        failed.extend(nvcc(&opts)?);
    } else if opts.wheels {
        failed.push("nvcc did not run, although --wheels installed it".into());
    } else {
        eprintln!("skipped nvcc: nvcc is not on PATH");
    }
    if opts.wheels {
        // NVRTC, as gpuio compiles the embedded sources, for every architecture: each
        // crate's `kernels` tests.
        let mut args = vec!["test".to_string()];
        for m in manifest::all()? {
            args.extend(["-p".into(), m.crate_name()]);
        }
        args.extend(["--test", "it", "--", "kernels::"].map(String::from));
        let nvrtc = run_tests(
            "NVRTC over the embedded kernels (each crate's kernels tests)",
            cargo().args(&args).env("GPUIO_REQUIRE_NVRTC", "1"),
        );
        if let Err(e) = nvrtc {
            failed.push(e);
        }
    }
    if opts.check
        && let Err(e) = check_ptx()
    {
        failed.push(e);
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(failed.join("; "))
    }
}

/// nvcc over every module of every crate's manifest, put together as gpuio embeds it, and
/// over a user kernel that includes the public device header `kernels/gpuio.cuh` the way nvcc
/// users do (`-I kernels`), to cubin for each architecture (so ptxas runs too).
fn nvcc(opts: &Options) -> Result<Vec<String>> {
    let tmp = temp_dir("nvcc")?;
    let mut sources = Vec::new();
    for m in manifest::all()? {
        for module in &m.modules {
            let mut text = String::new();
            for part in &module.sources {
                text.push_str(&read(&m.source(part)?)?);
            }
            let path = tmp.join(module.file_name());
            write(&path, &text)?;
            sources.push((path, None));
        }
    }
    let user = tmp.join("user_kernel.cu");
    write(
        &user,
        "#include \"gpuio.cuh\"\n\
         __global__ void user_kernel(const void* pool, gpuio_u64 rows, const gpuio_u64* idx,\n\
                                     gpuio_u64 n, void* dst, gpuio_u64* err) {\n\
             gpuio_gather_rows<8>(pool, rows, 64, idx, n, dst, err);\n\
         }\n",
    )?;
    sources.push((user, Some(root().join("kernels"))));
    let mut failed = Vec::new();
    for arch in &opts.archs {
        for (src, include) in &sources {
            let name = src.file_stem().unwrap_or_default().to_string_lossy();
            let out = tmp.join(format!("{name}.{arch}.cubin"));
            let what = format!("nvcc -arch={arch} {name}.cu");
            let mut cmd = Command::new("nvcc");
            if let Some(dir) = include {
                cmd.arg("-I").arg(dir);
            }
            cmd.args(["-arch", arch, "-cubin", "-o"]).arg(&out).arg(src);
            if run(&what, &mut cmd).is_err() {
                failed.push(what);
            }
        }
    }
    let _ = std::fs::remove_dir_all(&tmp);
    Ok(failed)
}

/// A fresh temporary directory, named for this process and `tag`.
fn temp_dir(tag: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("gpuio-ptx-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    Ok(dir)
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

fn read_bytes(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

fn write(path: &Path, text: &str) -> Result {
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}

/// The 64-bit FNV-1a hash (`gpuio_hal::kernels::fnv1a64`).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Fails unless `nvcc` is the version whose output the committed PTX is.
fn require_pinned_nvcc() -> Result {
    let out = Command::new("nvcc")
        .arg("--version")
        .output()
        .map_err(|e| {
            format!("the embedded PTX is built by nvcc, which did not run ({e}): add --wheels")
        })?;
    let text = String::from_utf8_lossy(&out.stdout);
    if text.contains(NVCC_VERSION) {
        return Ok(());
    }
    let found = text.lines().last().unwrap_or("no version");
    Err(format!(
        "the embedded PTX is built by CUDA 13.0's nvcc ({NVCC_VERSION}), not by this one \
         ({found}): add --wheels"
    ))
}

/// Builds every module of `m` for every architecture of [`PTX_ARCHS`] and of [`CUBIN_ARCHS`]
/// into `out`, and returns the file names. Each PTX file is a line naming the module, the
/// architecture and the hash of the source, a line saying where it came from, then nvcc's
/// output (which names the compiler's version but no path or time: the same sources give the
/// same bytes, which `--check` verifies by building twice). Each cubin is nvcc's output as it
/// is, with a stamp beside it (`<module>.sm_<arch>.stamp`) naming the source's hash and its
/// own.
fn generate(m: &Manifest, out: &Path) -> Result<Vec<String>> {
    let work = out.join("src");
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    let mut files = Vec::new();
    for module in &m.modules {
        let mut source = String::new();
        let mut shown = Vec::new();
        for part in &module.sources {
            source.push_str(&read(&m.source(part)?)?);
            shown.push(m.source_shown(part)?);
        }
        let name = module.file_name();
        let cu = work.join(&name);
        write(&cu, &source)?;
        for arch in PTX_ARCHS {
            let file = format!("{}.{arch}.ptx", module.name);
            let built = work.join(&file);
            let what = format!("nvcc -ptx -arch={arch} {name}");
            let mut cmd = Command::new("nvcc");
            cmd.args(["-ptx", "-arch", arch, "-o"]).arg(&built).arg(&cu);
            run(&what, &mut cmd)?;
            let ptx = read(&built)?;
            if ptx.contains(&*work.to_string_lossy()) {
                return Err(format!(
                    "{what}: the PTX names the build directory, so it would differ from one \
                     build to the next"
                ));
            }
            let header = format!(
                "// gpuio-ptx: {name} {arch} source-fnv1a64 {:016x}\n\
                 // Built by `cargo xtask ptx --write` from {}; do not edit.\n",
                fnv1a64(source.as_bytes()),
                shown.join(" + "),
            );
            write(&out.join(&file), &(header + &ptx))?;
            files.push(file);
        }
        for arch in CUBIN_ARCHS {
            let file = format!("{}.{arch}.cubin", module.name);
            let what = format!("nvcc -cubin -arch={arch} {name}");
            let mut cmd = Command::new("nvcc");
            cmd.args(["-cubin", "-arch", arch, "-o"])
                .arg(out.join(&file))
                .arg(&cu);
            run(&what, &mut cmd)?;
            let image = read_bytes(&out.join(&file))?;
            let stamp = format!("{}.{arch}.stamp", module.name);
            let text = format!(
                "gpuio-cubin: {name} {arch} source-fnv1a64 {:016x} image-fnv1a64 {:016x}\n",
                fnv1a64(source.as_bytes()),
                fnv1a64(&image),
            );
            write(&out.join(&stamp), &text)?;
            files.extend([file, stamp]);
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    Ok(files)
}

/// The device code files in `dir` (PTX, cubins and their stamps), by name (none where `dir`
/// does not exist).
fn ptx_files(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| [".ptx", ".cubin", ".stamp"].iter().any(|x| n.ends_with(x)))
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// `--write`: for every crate's manifest, builds the embedded PTX and replaces what differs in
/// the crate's `ptx/` (removing PTX files that no module and architecture make any more), and
/// writes the Rust that embeds it.
fn write_ptx() -> Result {
    require_pinned_nvcc()?;
    for m in manifest::all()? {
        let tmp = temp_dir("write")?;
        let files = generate(&m, &tmp)?;
        let (dir, shown) = (m.ptx_dir(), m.ptx_dir_shown());
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut changed = 0;
        for file in &files {
            let bytes = read_bytes(&tmp.join(file))?;
            if std::fs::read(dir.join(file)).ok().as_deref() != Some(bytes.as_slice()) {
                std::fs::write(dir.join(file), &bytes)
                    .map_err(|e| format!("{}: {e}", dir.join(file).display()))?;
                eprintln!("wrote {shown}/{file}");
                changed += 1;
            }
        }
        for old in ptx_files(&dir).into_iter().filter(|f| !files.contains(f)) {
            std::fs::remove_file(dir.join(&old)).map_err(|e| format!("{old}: {e}"))?;
            eprintln!("removed {shown}/{old}");
            changed += 1;
        }
        let _ = std::fs::remove_dir_all(&tmp);
        eprintln!("{shown}: {} files, {changed} changed", files.len());
    }
    let rust = manifest::write_rust()?;
    eprintln!("kernel module Rust: {rust} files changed");
    Ok(())
}

/// `--check`: builds every manifest's PTX twice in temporary directories and fails, naming
/// each file, where the two builds differ (the compiler is not reproducible) or where the
/// committed files differ from them (stale, missing, or left over), or where the generated
/// Rust is stale.
fn check_ptx() -> Result {
    require_pinned_nvcc()?;
    let mut problems = manifest::stale_rust()?;
    let mut count = 0;
    for m in manifest::all()? {
        let (a, b) = (temp_dir("check-a")?, temp_dir("check-b")?);
        let files = generate(&m, &a)?;
        generate(&m, &b)?;
        let (dir, shown) = (m.ptx_dir(), m.ptx_dir_shown());
        for file in &files {
            let fresh = read_bytes(&a.join(file))?;
            if read_bytes(&b.join(file))? != fresh {
                problems.push(format!(
                    "{file}: nvcc built it differently twice from the same source, so it \
                     cannot be checked"
                ));
                continue;
            }
            match std::fs::read(dir.join(file)) {
                Err(_) => problems.push(format!("{shown}/{file} is missing")),
                Ok(committed) if committed != fresh => {
                    let (c, f) = (
                        String::from_utf8_lossy(&committed),
                        String::from_utf8_lossy(&fresh),
                    );
                    let how = if file.ends_with(".ptx") {
                        first_difference(&c, &f)
                    } else if file.ends_with(".stamp") {
                        format!("it says {:?}, a fresh build {:?}", c.trim(), f.trim())
                    } else {
                        "its bytes differ from a fresh build's".into()
                    };
                    problems.push(format!(
                        "{shown}/{file} is stale: it is not what nvcc builds from its sources \
                         now; {how}"
                    ));
                }
                Ok(_) => {}
            }
        }
        for extra in ptx_files(&dir).into_iter().filter(|f| !files.contains(f)) {
            problems.push(format!(
                "{shown}/{extra} is built from no module and architecture any more"
            ));
        }
        count += files.len();
        let _ = std::fs::remove_dir_all(&a);
        let _ = std::fs::remove_dir_all(&b);
    }
    if problems.is_empty() {
        eprintln!("embedded device code: {count} files match their sources");
        return Ok(());
    }
    Err(format!(
        "the embedded kernels do not match their sources:\n  {}\n(after changing a kernel \
         or a kernels.toml, run `cargo xtask ptx --wheels --write` and commit what it writes)",
        problems.join("\n  ")
    ))
}

/// Where a committed PTX file first differs from a fresh build.
fn first_difference(committed: &str, fresh: &str) -> String {
    // The first two lines name the source (and its hash); the rest is nvcc's.
    let code = committed
        .lines()
        .zip(fresh.lines())
        .skip(2)
        .position(|(c, f)| c != f)
        .map(|i| i + 3)
        .or_else(|| {
            let (c, f) = (committed.lines().count(), fresh.lines().count());
            (c != f).then_some(c.min(f) + 1)
        });
    match code {
        Some(line) => format!("the PTX itself first differs at line {line}"),
        None => "only its header differs (the source changed, not the code)".into(),
    }
}

/// Installs the pinned wheels under `target/cuda-wheels` (once) and runs this task again with
/// their nvcc on `PATH` and their libnvrtc on the loader's path (read only at process start).
fn rerun_with_wheels(args: &[String]) -> Result {
    let dir = root().join("target/cuda-wheels");
    crate::python::pip_target(&dir, WHEELS, "install CUDA 13.0's nvcc and NVRTC from PyPI")?;
    let cuda = dir.join("nvidia/cu13");
    let path = prepend(&cuda.join("bin"), "PATH");
    let libs = prepend(&cuda.join("lib"), "LD_LIBRARY_PATH");
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    run(
        "kernels with the wheels' nvcc and NVRTC",
        Command::new(exe)
            .arg("ptx")
            .args(args)
            .env("PATH", path)
            .env("LD_LIBRARY_PATH", libs)
            .env(WHEELS_ENV, "1"),
    )
}

fn prepend(dir: &Path, var: &str) -> std::ffi::OsString {
    let mut paths = vec![dir.to_path_buf()];
    if let Some(old) = std::env::var_os(var) {
        paths.extend(std::env::split_paths(&old));
    }
    std::env::join_paths(paths).unwrap_or_else(|_| dir.as_os_str().to_owned())
}
