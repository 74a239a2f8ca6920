//! Finding NIXL's C API library at run time. nixl-sys is built with its `stub-api`: each of its
//! calls resolves `libnixl_capi.so` with `dlopen` by that name on first use, and aborts the
//! process where it is missing. So before any NIXL call, gpuio loads the library itself, from
//! the first place that has it: the stub's `dlopen` by name then finds the loaded object (the
//! dynamic linker matches a loaded library's soname) instead of searching. Where no place has it, every NIXL
//! call of gpuio's is refused with `Unsupported` and the reason, and nixl-sys is never called.

use gpuio_hal::{HalError, Result};
use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The library's file name, as NIXL installs it and its wheels carry it.
const CAPI: &str = "libnixl_capi.so";

/// NIXL as this process found it.
#[derive(Debug, Clone)]
pub struct NixlLibrary {
    /// The C API library loaded (`None`: found by the dynamic linker's own search, by name).
    pub path: Option<PathBuf>,
    /// The installed package's version, where a wheel's metadata lies beside the library.
    pub version: Option<String>,
    /// The backend plugins NIXL can load (UCX, POSIX, GDS, ...).
    pub plugins: Vec<String>,
}

/// NIXL, loaded on first use: the library, or why there is none.
pub fn library() -> Result<&'static NixlLibrary> {
    static FOUND: OnceLock<std::result::Result<NixlLibrary, String>> = OnceLock::new();
    FOUND
        .get_or_init(load)
        .as_ref()
        .map_err(|reason| HalError::Unsupported {
            what: "NIXL",
            reason: reason.clone(),
        })
}

fn load() -> std::result::Result<NixlLibrary, String> {
    spare_ib_module();
    let mut tried = Vec::new();
    let mut path = None;
    for candidate in candidates() {
        match open(&candidate) {
            Ok(()) => {
                path = Some(candidate);
                break;
            }
            Err(why) => tried.push(why),
        }
    }
    if path.is_none() {
        // Last, the dynamic linker's own search (LD_LIBRARY_PATH, the cache, rpaths).
        if let Err(why) = open(Path::new(CAPI)) {
            tried.push(why);
            return Err(format!(
                "{CAPI} not found (install PyPI's nixl-cu13 or nixl-cu12, or set \
                 GPUIO_NIXL_LIB to the library or its folder); tried: {}",
                tried.join("; ")
            ));
        }
    }
    if nixl_sys::is_stub() {
        return Err(format!(
            "{CAPI} was loaded, but nixl-sys's stub resolved no library (a soname other than \
             {CAPI}?)"
        ));
    }
    let version = path.as_deref().and_then(wheel_version);
    let plugins = crate::agent::available_plugins()
        .map_err(|e| format!("{CAPI} loaded, but listing its plugins failed: {e}"))?;
    Ok(NixlLibrary {
        path,
        version,
        plugins,
    })
}

/// Whether UCX may use its TCP transport in this process, as `UCX_TLS` says (unset: every
/// transport). Over TCP (and UCX's other software paths) UCX serves one-sided reads and writes
/// by copying at whatever address the peer names, with no key check: any peer that reaches
/// the process's UCX ports can read and write its memory. RDMA and `cuda_ipc` check keys;
/// shared memory and CMA need the same user's rights on the same host.
pub fn ucx_tcp_enabled() -> bool {
    tcp_in(std::env::var("UCX_TLS").ok().as_deref())
}

/// [`ucx_tcp_enabled`] for a `UCX_TLS` value.
fn tcp_in(tls: Option<&str>) -> bool {
    let Some(tls) = tls.map(str::trim).filter(|t| !t.is_empty()) else {
        return true;
    };
    let (excluding, list) = match tls.strip_prefix('^') {
        Some(rest) => (true, rest),
        None => (false, tls),
    };
    let named = list
        .split(',')
        .map(str::trim)
        .any(|t| t == "tcp" || t == "all" && !excluding);
    named != excluding
}

/// PyPI's NIXL wheels crash the process at exit (in the destructors of the libnl-route they
/// carry) once UCX has loaded its `ib` transport module on a machine with no RDMA device, where
/// that module can serve nothing. There, unless the program set `UCX_MODULES` itself, gpuio
/// leaves the module out before UCX reads its configuration (when the UCX backend loads).
fn spare_ib_module() {
    if std::env::var_os("UCX_MODULES").is_some() || Path::new("/sys/class/infiniband").exists() {
        return;
    }
    // SAFETY: setting a variable races other threads that read or write the environment at
    // the same moment. This runs once, before NIXL and UCX (its readers) are loaded; gpuio's
    // own threads never touch the environment, and the docs tell programs whose threads do
    // to set UCX_MODULES themselves.
    unsafe { std::env::set_var("UCX_MODULES", "^ib") };
}

/// `dlopen`s `path` for good (never closed: nixl-sys keeps its symbols).
fn open(path: &Path) -> std::result::Result<(), String> {
    let c = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| format!("{}: a NUL in the path", path.display()))?;
    // SAFETY: a NUL-terminated path; loading a library runs its initializers, which is what
    // using NIXL means. The handle is leaked on purpose: the library stays loaded.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if !handle.is_null() {
        return Ok(());
    }
    // SAFETY: dlerror returns the calling thread's last dlopen error, a C string or null.
    let err = unsafe { libc::dlerror() };
    let why = if err.is_null() {
        "unknown error".to_string()
    } else {
        // SAFETY: non-null: a NUL-terminated string owned by libdl, copied before any other
        // dl call.
        unsafe { std::ffi::CStr::from_ptr(err) }
            .to_string_lossy()
            .into_owned()
    };
    Err(format!("{}: {why}", path.display()))
}

/// Where the library may be, in order: `GPUIO_NIXL_LIB` (the file or its folder), then
/// `NIXL_PREFIX`'s library folders and NIXL's default prefix, then the Python environments'
/// site packages where PyPI's wheels put it.
fn candidates() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(p) = std::env::var_os("GPUIO_NIXL_LIB").map(PathBuf::from) {
        if p.is_file() {
            return vec![p];
        }
        dirs.push(p);
    }
    let arch = format!("{}-linux-gnu", std::env::consts::ARCH);
    let prefixes = std::env::var_os("NIXL_PREFIX")
        .map(PathBuf::from)
        .into_iter()
        .chain([PathBuf::from("/opt/nvidia/nvda_nixl")]);
    for p in prefixes {
        dirs.extend([p.join("lib").join(&arch), p.join("lib64"), p.join("lib")]);
    }
    let envs = ["VIRTUAL_ENV", "CONDA_PREFIX"]
        .iter()
        .filter_map(|v| std::env::var_os(v).map(PathBuf::from))
        .chain(["/usr/local", "/usr"].map(PathBuf::from));
    for env in envs {
        for site in site_packages(&env) {
            // meson-python wheels keep their libraries in `.<package>.mesonpy.libs`.
            for package in ["nixl_cu13", "nixl_cu12", "nixl"] {
                dirs.push(site.join(format!(".{package}.mesonpy.libs")));
            }
        }
    }
    dirs.into_iter()
        .map(|d| d.join(CAPI))
        .filter(|f| f.is_file())
        .collect()
}

/// `<env>/lib/python3.*/{site,dist}-packages`, the ones that exist.
fn site_packages(env: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(env.join("lib")) else {
        return Vec::new();
    };
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
        .flat_map(|e| ["site-packages", "dist-packages"].map(|s| e.path().join(s)))
        .filter(|p| p.is_dir())
        .collect();
    found.sort();
    found
}

/// The version in the name of the wheel's `.dist-info` folder beside the library's folder
/// (`nixl_cu13-1.5.1.dist-info`).
fn wheel_version(lib: &Path) -> Option<String> {
    let site = lib.parent()?.parent()?;
    let mut names: Vec<String> = std::fs::read_dir(site)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("nixl") && n.ends_with(".dist-info"))
        .collect();
    names.sort();
    let name = names.pop()?;
    let stem = name.strip_suffix(".dist-info")?;
    let (package, version) = stem.rsplit_once('-')?;
    Some(format!("{version} ({package})"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wheels_version_comes_from_its_dist_info() {
        let site = std::env::temp_dir().join(format!("gpuio-nixl-site-{}", std::process::id()));
        let libs = site.join(".nixl_cu13.mesonpy.libs");
        std::fs::create_dir_all(&libs).unwrap();
        std::fs::create_dir_all(site.join("nixl_cu13-1.5.1.dist-info")).unwrap();
        std::fs::create_dir_all(site.join("numpy-2.1.0.dist-info")).unwrap();
        let got = wheel_version(&libs.join(CAPI));
        std::fs::remove_dir_all(&site).unwrap();
        assert_eq!(got.as_deref(), Some("1.5.1 (nixl_cu13)"));
    }

    #[test]
    fn ucx_tls_decides_whether_tcp_is_on() {
        for (tls, tcp) in [
            (None, true),
            (Some(""), true),
            (Some("all"), true),
            (Some("tcp"), true),
            (Some("rc,tcp,sm"), true),
            (Some("^tcp"), false),
            (Some("^ib,tcp"), false),
            (Some("^ib"), true),
            (Some("rc,cuda_ipc,sm,cma"), false),
            (Some("^all"), true),
        ] {
            assert_eq!(tcp_in(tls), tcp, "{tls:?}");
        }
    }

    #[test]
    fn a_missing_file_is_refused_with_the_linkers_reason() {
        let why = open(Path::new("/nonexistent/libnixl_capi.so")).unwrap_err();
        assert!(why.starts_with("/nonexistent/libnixl_capi.so: "), "{why}");
        assert!(why.contains("No such file"), "{why}");
    }
}
