//! `gpuio info`: devices, capabilities, and every IO path with whether it is available here
//! and why not.

use bytesize::ByteSize;
use gpuio_api::{Config, Error, Session, escape_path};
use gpuio_hal::{Backend, Capability, DeviceInfo, Gpu, NumaTopology};
use serde::Serialize;

#[derive(Debug, clap::Args)]
pub struct InfoArgs {
    /// Print the facts as JSON.
    #[arg(long)]
    json: bool,
    /// Print the configuration in effect (TOML) instead.
    #[arg(long)]
    show_config: bool,
}

/// One way of moving data, and whether it works here.
#[derive(Debug, Serialize)]
struct IoPath {
    engine: &'static str,
    path: String,
    available: bool,
    detail: String,
}

impl IoPath {
    fn new(engine: &'static str, path: impl Into<String>, cap: Capability) -> Self {
        Self {
            engine,
            path: path.into(),
            available: cap.available,
            detail: cap.detail,
        }
    }
}

#[derive(Debug, Serialize)]
struct Report {
    version: &'static str,
    config_source: String,
    backend: &'static str,
    cuda: Capability,
    devices: Vec<DeviceInfo>,
    numa: NumaTopology,
    transparent_huge_pages: Option<String>,
    paths: Vec<IoPath>,
}

fn io_paths(session: &Session) -> Vec<IoPath> {
    let memio = session.memio();
    let gpus = session.gpus();
    let mut paths = Vec::new();
    let gpu0 = &gpus[0];
    let cuda = gpu0.backend() == Backend::Cuda;
    let probe = vec![0u8; 64 << 20];
    paths.push(IoPath::new(
        "memio",
        "pinned host <-> GPU",
        if cuda {
            Capability::yes(gpuio_api::MemIoRoute::DirectDma.to_string())
        } else {
            Capability::yes("CPU copy (host backend: no GPU)")
        },
    ));
    paths.push(IoPath::new(
        "memio",
        "pageable host <-> GPU (64 MiB)",
        Capability::yes(memio.route_host_device(gpu0, &probe).to_string()),
    ));
    paths.push(IoPath::new(
        "memio",
        "GPU <-> GPU (peer)",
        match gpus.get(1) {
            Some(g1) => Capability::yes(memio.route_device_device(gpu0, g1).to_string()),
            None => Capability::no("one device"),
        },
    ));
    paths.push(IoPath::new(
        "memio",
        "CXL memory (memio://cxl/...)",
        gpu0.info().cxl.clone(),
    ));
    let nodes = memio.topology().nodes.len();
    paths.push(IoPath::new(
        "memio",
        "NUMA-placed host memory (memio://cpu/dram?numa=N)",
        Capability::yes(format!(
            "{nodes} NUMA node(s): {}",
            memio.topology().online_list()
        )),
    ));
    let localio = session.localio();
    let (engine, why) = localio.engine();
    paths.push(IoPath::new(
        "localio",
        "files <-> GPU: what AUTO picks",
        Capability::yes(localio.explain(gpu0)),
    ));
    paths.push(IoPath::new(
        "localio",
        "files: io_uring (fixed buffers and files, O_DIRECT)",
        if engine == gpuio_api::IoEngine::Uring {
            Capability::yes(why)
        } else {
            Capability::no(why)
        },
    ));
    paths.push(IoPath::new(
        "localio",
        "files: pread/pwrite lanes (fallback)",
        Capability::yes("always available"),
    ));
    paths.push(IoPath::new(
        "localio",
        "files: GPUDirect Storage (cuFile)",
        match gpu0.gds() {
            Ok((mode, lib)) => Capability {
                available: mode == gpuio_hal::GdsMode::Native,
                detail: format!("{lib}: {mode}; {}", gpu0.info().gds.detail),
            },
            Err(e) => Capability::no(e.to_string()),
        },
    ));
    paths.extend(remote_paths(session));
    paths.extend(gpu_initiated_paths(gpu0));
    paths
}

/// RemoteIO: what this build has (cargo features) and what the machine has (RDMA devices).
fn remote_paths(session: &Session) -> Vec<IoPath> {
    let gpu0 = &session.gpus()[0];
    let gdr = &gpu0.info().gdr;
    let registry = if cfg!(feature = "registry") {
        let n = session.config().remote.registry.len();
        Capability::yes(if n == 0 {
            "built in; no [remote] registry endpoints configured".to_string()
        } else {
            format!("built in; {n} endpoint(s) in [remote] registry")
        })
    } else {
        Capability::no(gpuio_api::REGISTRY_ABSENT)
    };
    vec![
        IoPath::new(
            "remoteio",
            "TCP (remoteio://host:port/..., gpuio agent)",
            Capability::yes("always built in"),
        ),
        IoPath::new(
            "remoteio",
            "TLS (rustls)",
            Capability::yes("always built in: [agent] tls_cert + tls_key, [remote] tls_ca"),
        ),
        IoPath::new("remoteio", "RDMA verbs (?transport=rdma)", rdma()),
        IoPath::new("remoteio", "NIXL (?transport=nixl, UCX)", nixl()),
        IoPath::new(
            "remoteio",
            "GPUDirect RDMA (gdr=1)",
            // Even where the machine has it, gpuio does not register GPU memory with a NIC.
            Capability::no(format!(
                "{}{}; GPU memory is staged through pinned host buffers (registering GPU \
                 memory with a NIC is not built)",
                if gdr.available {
                    "the machine has it: "
                } else {
                    ""
                },
                gdr.detail
            )),
        ),
        IoPath::new(
            "remoteio",
            "etcd registry (remoteio://<segment>/...)",
            registry,
        ),
    ]
}

#[cfg(feature = "rdma")]
fn rdma() -> Capability {
    match gpuio_rdma::device_names() {
        Ok(names) if !names.is_empty() => {
            Capability::yes(format!("built in; device(s): {}", names.join(", ")))
        }
        Ok(_) => Capability::no(
            "built in, but no RDMA device found (no NIC with verbs, no rxe or siw soft device)",
        ),
        // libibverbs says ENOSYS where the kernel has no RDMA subsystem (no
        // /sys/class/infiniband).
        Err(gpuio_hal::HalError::Rdma {
            code: gpuio_hal::ErrorCode::Unsupported,
            ..
        }) => Capability::no(
            "built in, but this kernel has no RDMA devices (no /sys/class/infiniband)",
        ),
        Err(e) => Capability::no(format!("built in, but listing RDMA devices failed: {e}")),
    }
}

#[cfg(not(feature = "rdma"))]
fn rdma() -> Capability {
    Capability::no("not in this build (cargo feature `rdma`, which needs libibverbs-dev)")
}

#[cfg(feature = "nixl")]
fn nixl() -> Capability {
    match gpuio_nixl::library() {
        Ok(lib) => Capability::yes(format!(
            "{}, version {}; plugins: {}; UCX picks its transports at run time (UCX_TLS: {}); \
             memory exports to keys that may write them ([agent] nixl = true{})",
            lib.path
                .as_ref()
                .map_or("found by the dynamic linker".into(), |p| p
                    .display()
                    .to_string()),
            lib.version.as_deref().unwrap_or("unknown"),
            lib.plugins.join(", "),
            std::env::var("UCX_TLS").unwrap_or_else(|_| "unset".into()),
            if gpuio_nixl::ucx_tcp_enabled() {
                "; UCX may use TCP here, which checks no keys: an agent also needs \
                 nixl_tcp = true, or UCX_TLS=^tcp"
            } else {
                ""
            },
        )),
        Err(e) => Capability::no(e.to_string()),
    }
}

#[cfg(not(feature = "nixl"))]
fn nixl() -> Capability {
    Capability::no("not in this build (cargo feature `nixl`)")
}

/// Row gathers and the request ring: GPU kernels on the CUDA backend (checked by loading them
/// as gpuio does, and setting up a ring), the CPU on the host backend.
fn gpu_initiated_paths(gpu0: &Gpu) -> Vec<IoPath> {
    let info = gpu0.info();
    let (gathers, ring) = match gpu0.backend() {
        Backend::Host => (
            Capability::yes(
                "host backend: the row jobs run on the CPU (its emulation of the GPU kernels, \
                 in list order), beside the CPU-staged path",
            ),
            Capability::no(
                "the host backend runs no kernels; host threads can play the GPU's part \
                 (ring::HostProducer) against the same RingProxy",
            ),
        ),
        Backend::Cuda if !info.can_map_host_memory => {
            let why = "this device cannot map host memory, which the kernels read and write";
            (Capability::no(why), Capability::no(why))
        }
        Backend::Cuda => {
            // Loaded as gpuio loads them: embedded PTX, or NVRTC where none fits the device.
            let loaded = |k: &'static gpuio_hal::kernels::KernelSource| {
                gpu0.load_kernels(k).map_err(|e| e.to_string())
            };
            let gathers = match loaded(&gpuio_hal::kernels::GATHER) {
                Ok(origin) => Capability::yes(format!(
                    "GPU threads over mapped pinned memory (list or address order), CPU-staged \
                     or hybrid: MemIo::gather measures and picks (kernels: {origin})"
                )),
                Err(e) => Capability::no(format!("the row kernels do not load: {e}")),
            };
            let ring = loaded(&gpuio_ring::kernels::RING_BENCH).and_then(|origin| {
                gpuio_ring::RingMemory::new(gpuio_ring::MIN_SLOTS, gpu0)
                    .map(|_| origin)
                    .map_err(|e| format!("setting up a ring: {e}"))
            });
            let ring = match ring {
                Ok(origin) => Capability::yes(format!(
                    "kernels post IO through mapped pinned memory (kernels/gpuio.cuh); \
                     RingProxy threads serve it through every engine (test kernels: {origin})"
                )),
                Err(e) => Capability::no(e),
            };
            (gathers, ring)
        }
    };
    let mut paths = vec![
        IoPath::new(
            "gpu-initiated",
            "row gathers / scatters (MemIo::gather)",
            gathers,
        ),
        IoPath::new(
            "gpu-initiated",
            "request ring (gpuio_read from kernels)",
            ring,
        ),
    ];
    for (tier, cap) in gpuio_nvme::tiers::tiers(gpu0) {
        paths.push(IoPath::new(
            "gpu-initiated",
            format!("NVMe queues: {tier}"),
            cap,
        ));
    }
    paths
}

pub fn run(config: Config, args: &InfoArgs) -> Result<(), Error> {
    if args.show_config {
        print!("{}", config.to_toml());
        return Ok(());
    }
    let config_source = config
        .source
        .as_ref()
        .map_or_else(|| "built-in defaults".into(), |p| escape_path(p));
    let session = Session::new(config)?;
    let report = Report {
        version: env!("CARGO_PKG_VERSION"),
        config_source,
        backend: session.gpus()[0].backend().name(),
        cuda: session.probe().cuda.clone(),
        devices: session.gpus().iter().map(|g| g.info().clone()).collect(),
        numa: session.memio().topology().clone(),
        transparent_huge_pages: gpuio_hal::memory::numa::transparent_huge_pages(),
        paths: io_paths(&session),
    };
    if args.json {
        let text = serde_json::to_string_pretty(&report)
            .map_err(|e| Error::Invalid(format!("rendering JSON: {e}")))?;
        println!("{text}");
        return Ok(());
    }
    print_human(&report);
    Ok(())
}

fn yes_no(available: bool) -> &'static str {
    if available { "yes" } else { "no " }
}

fn print_human(r: &Report) {
    println!("gpuio {} (configuration: {})", r.version, r.config_source);
    println!(
        "backend: {}  (CUDA: {} — {})",
        r.backend,
        if r.cuda.available {
            "available"
        } else {
            "unavailable"
        },
        r.cuda.detail
    );
    for d in &r.devices {
        let cc = d
            .compute_capability
            .map_or_else(String::new, |(a, b)| format!("  sm_{a}{b}"));
        println!(
            "\ngpu{}  {}  {}{}  {} SMs/threads  {} copy engines",
            d.ordinal,
            d.name,
            ByteSize(d.total_memory).display().iec(),
            cc,
            d.multiprocessors,
            d.copy_engines
        );
        if let Some(bus) = &d.pci_bus_id {
            let link = d.pcie.as_ref().map_or_else(
                || "link not shown by sysfs".into(),
                |l| {
                    format!(
                        "{} x{} (max {} x{})",
                        l.speed, l.width, l.max_speed, l.max_width
                    )
                },
            );
            let numa = d
                .numa_node
                .map_or_else(|| "unknown".into(), |n| n.to_string());
            let driver = d
                .driver_version
                .map_or_else(String::new, |(a, b)| format!("  driver CUDA {a}.{b}"));
            println!("      PCI {bus}  {link}  NUMA node {numa}{driver}");
        }
        for (name, c) in [
            ("GDS", &d.gds),
            ("GDR", &d.gdr),
            ("CXL", &d.cxl),
            ("page cache DMA", &d.page_cache_dma),
            ("dma-buf export", &d.dma_buf),
        ] {
            println!("      {name}  {}  {}", yes_no(c.available), c.detail);
        }
    }
    let nodes: Vec<String> = r
        .numa
        .nodes
        .iter()
        .map(|n| {
            format!(
                "node{} ({} CPUs, {}{})",
                n.id,
                n.cpus.len(),
                ByteSize(n.memory_bytes).display().iec(),
                if n.is_memory_only() {
                    ", memory-only: CXL"
                } else {
                    ""
                }
            )
        })
        .collect();
    println!(
        "\nhost: {}; transparent huge pages: {}",
        nodes.join(", "),
        r.transparent_huge_pages.as_deref().unwrap_or("unknown")
    );
    println!("\nIO paths:");
    for p in &r.paths {
        println!(
            "  {:<14} {:<50} {}  {}",
            p.engine,
            p.path,
            yes_no(p.available),
            p.detail
        );
    }
}
