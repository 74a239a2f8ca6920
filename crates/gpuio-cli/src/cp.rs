//! `gpuio cp SRC DST [--via URI] [--verify]`.
//!
//! A file destination is written under a temporary name and renamed when complete; SIGINT,
//! SIGTERM or SIGHUP during the copy remove that partial file before gpuio exits (with 128 +
//! the signal's number). SIGKILL cannot be caught: the next copy to the destination removes
//! what it left.

use bytesize::ByteSize;
use gpuio_api::{Config, CopyOptions, Error, Resource, Session, Uri};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Debug, clap::Args)]
pub struct CpArgs {
    /// Source: a file (path, file:///path or localio:///path) or another node's export
    /// (remoteio://HOST:PORT/EXPORT, remoteio://SEGMENT/EXPORT).
    src: String,
    /// Destination: a file, another node's export, or memory (gpu0, memio://cpu/dram?numa=N,
    /// memio://cxl/POOL) that holds the bytes until the command exits.
    dst: String,
    /// Stage through a memory tier, e.g. gpu0 or memio://cpu/dram?numa=1.
    #[arg(long, value_name = "URI")]
    via: Option<String>,
    /// Compare crc32c checksums of source and destination before reporting success.
    #[arg(long)]
    verify: bool,
    /// Bytes per step (and the size of the --via buffer).
    #[arg(long, default_value = "64MiB", value_name = "SIZE")]
    window: ByteSize,
    /// Flush a file destination to stable storage (fdatasync) before reporting success.
    #[arg(long)]
    durable: bool,
    /// No progress bar or summary.
    #[arg(short, long)]
    quiet: bool,
}

pub fn run(config: Config, args: &CpArgs) -> Result<(), Error> {
    let src = Uri::parse(&args.src)?;
    let dst = Uri::parse(&args.dst)?;
    let via = args.via.as_deref().map(Uri::parse).transpose()?;
    let window = usize::try_from(args.window.as_u64())
        .map_err(|_| Error::Invalid(format!("--window {} is too large", args.window)))?;
    let session = Session::new(config)?;
    let opts = CopyOptions {
        via,
        verify: args.verify,
        window,
        durable: args.durable,
    };
    let bar = if args.quiet {
        ProgressBar::hidden()
    } else {
        let bar = ProgressBar::new(0);
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar
    };
    if let Ok(Resource::File(f)) = session.open(&src, 0, gpuio_api::Access::Read) {
        bar.set_length(f.len().unwrap_or(0));
    }
    if let Uri::File { path, .. } = &dst {
        clean_up_on_signals(path.clone())?;
    }
    let report = session.copy(&src, &dst, &opts, &mut |done| bar.set_position(done))?;
    bar.finish_and_clear();
    if !args.quiet {
        let mut route = vec![format!("{src}")];
        if let Some(v) = &opts.via {
            route.push(format!("{v}"));
        }
        route.push(format!("{dst}"));
        println!(
            "copied {} in {:.3} s ({:.2} GB/s): {} [{}]{}",
            ByteSize(report.bytes).display().iec(),
            report.elapsed.as_secs_f64(),
            report.gbps(),
            route.join(" -> "),
            report
                .stages
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("; "),
            match (report.checksum, report.verify_elapsed) {
                (Some(c), Some(t)) =>
                    format!("; crc32c {c:08x} verified in {:.3} s", t.as_secs_f64()),
                _ => String::new(),
            }
        );
        if dst.is_memory() {
            println!("note: {dst} is memory; its copy is released when gpuio exits");
        }
    }
    Ok(())
}

/// Watches for SIGINT, SIGTERM and SIGHUP on a thread of its own: on one, removes this
/// process's partial file for `target` and exits with 128 + the signal's number.
fn clean_up_on_signals(target: std::path::PathBuf) -> Result<(), Error> {
    use tokio::signal::unix::{SignalKind, signal};
    let io = |e: std::io::Error| Error::Invalid(format!("watching for signals: {e}"));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(io)?;
    // Registered here, before the copy starts, so no signal can slip past the handlers.
    let (mut int, mut term, mut hup) = rt
        .block_on(async {
            Ok::<_, std::io::Error>((
                signal(SignalKind::interrupt())?,
                signal(SignalKind::terminate())?,
                signal(SignalKind::hangup())?,
            ))
        })
        .map_err(io)?;
    std::thread::Builder::new()
        .name("gpuio-signals".into())
        .spawn(move || {
            let signo = rt.block_on(async {
                tokio::select! {
                    _ = int.recv() => 2,
                    _ = term.recv() => 15,
                    _ = hup.recv() => 1,
                }
            });
            let removed = gpuio_api::discard_partial_copies();
            eprintln!(
                "gpuio: interrupted by signal {signo}; removed {removed} partial file(s) of {}",
                target.display()
            );
            std::process::exit(128 + signo);
        })
        .map_err(io)?;
    Ok(())
}
