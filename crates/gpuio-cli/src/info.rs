//! `gpuio info`: devices, capabilities, and every IO path with whether it is available here
//! and why not.

use bytesize::ByteSize;
use gpuio_api::{Config, Error, Session};
use gpuio_hal::{Backend, Capability, DeviceInfo, NumaTopology};
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

fn not_built(what: &str) -> Capability {
    Capability::no(format!("{what} is not in this build"))
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
            Capability::yes(gpuio_api::Route::DirectDma.to_string())
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
        if engine == gpuio_api::LocalEngine::Uring {
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
    paths.push(IoPath::new(
        "remoteio",
        "TCP / RDMA / GPUDirect RDMA",
        not_built("RemoteIO"),
    ));
    paths.push(IoPath::new(
        "gpu-initiated",
        "kernel loads/stores of host memory, request ring",
        not_built("GPU-initiated IO"),
    ));
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
        .map_or_else(|| "built-in defaults".into(), |p| p.display().to_string());
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
        for (name, c) in [("GDS", &d.gds), ("GDR", &d.gdr), ("CXL", &d.cxl)] {
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
