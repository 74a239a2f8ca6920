//! `gpuio`: what the machine can do (`info`), copies between any two resources (`cp`), and
//! the benchmark suites against their peers (`bench`).
//!
//! Exit status: 0 on success; otherwise the magnitude of the error code
//! (docs/REFERENCE.md#error-codes: 3 for an invalid argument, 4 for something not found, 8 for
//! unsupported, ...); 2 for bad usage.

#![forbid(unsafe_code)]

mod agent;
#[cfg(feature = "bench")]
mod bench;
mod cp;
mod info;
#[cfg(feature = "nixl")]
mod nixl;
mod stat;

use clap::{Parser, Subcommand};
use gpuio_api::{Config, Error};
use gpuio_hal::BackendPreference;
use std::path::PathBuf;
use std::process::ExitCode;

// The scheduler hands every request from the submitting thread to a worker; glibc's malloc
// makes such cross-thread frees expensive, mimalloc does not. Its v2 series: v3 collected
// pages in the freeing worker (`mi_free_try_collect_mt`), which cost the scheduler's
// 4 KiB request rate up to 7% on the GPU machine (docs/PERF.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Moves data between GPU memory, host memory (DRAM, CXL) and storage, on the fastest path
/// the machine has.
#[derive(Debug, Parser)]
#[command(name = "gpuio", version, about)]
struct Cli {
    /// Configuration file (TOML); default: $GPUIO_CONFIG, else the built-in defaults.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// GPU backend: auto, cuda or host (overrides the configuration).
    #[arg(long, global = true, value_name = "BACKEND")]
    backend: Option<BackendPreference>,
    /// Serve metrics for Prometheus on this address while the command runs (default
    /// 127.0.0.1:9464 when given without a value).
    #[arg(long, global = true, value_name = "HOST:PORT", num_args = 0..=1,
          default_missing_value = stat::DEFAULT_ADDR)]
    metrics_addr: Option<std::net::SocketAddr>,
    /// Keep serving metrics this many seconds after the command ends (for a last scrape;
    /// 0 to 86400, fractions allowed).
    #[arg(long, global = true, value_name = "SECS", default_value = "0",
          value_parser = parse_seconds, allow_negative_numbers = true)]
    metrics_linger: std::time::Duration,
    /// More log output (-v: info, -vv: debug); GPUIO_LOG sets a full filter.
    #[arg(short, long, global = true, action = clap::ArgAction::Count)]
    verbose: u8,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Devices, capabilities, and every IO path with whether it is available and why not.
    Info(info::InfoArgs),
    /// Copies SRC to DST (URIs or paths), optionally staged through a memory tier.
    Cp(cp::CpArgs),
    /// Runs benchmark suites against their peers; prints a table, writes JSON and a plot.
    #[cfg(feature = "bench")]
    Bench(bench::BenchArgs),
    /// Reads a running gpuio's metrics endpoint and prints a summary.
    Stat(stat::StatArgs),
    /// Serves this node's exports (`[agent]` in the configuration) to other nodes until
    /// SIGINT or SIGTERM; `gpuio agent keygen` makes a key secret.
    Agent(agent::AgentArgs),
    /// Prints a memory export's NIXL metadata for a program using NIXL's own API, and holds
    /// the session that keeps it valid until SIGINT or SIGTERM.
    #[cfg(feature = "nixl")]
    NixlExport(nixl::NixlExportArgs),
}

/// The longest wait a command line may ask for (`--metrics-linger`, `stat --watch`).
const MAX_SECONDS: f64 = 86_400.0;

/// A number of seconds (fractions allowed) from 0 to a day, parsed by clap so that a bad
/// value is a usage error, never a panic converting it (`inf`, `1e300`, `-1`, `NaN`).
pub(crate) fn parse_seconds(s: &str) -> Result<std::time::Duration, String> {
    let secs: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    if !(0.0..=MAX_SECONDS).contains(&secs) {
        return Err(format!(
            "{s:?} seconds is out of range: expected 0 to {MAX_SECONDS} (one day)"
        ));
    }
    std::time::Duration::try_from_secs_f64(secs).map_err(|e| format!("{s:?} seconds: {e}"))
}

fn init_logging(config: &Config, verbose: u8) {
    let filter = match verbose {
        0 => std::env::var("GPUIO_LOG")
            .or_else(|_| std::env::var("RUST_LOG"))
            .unwrap_or_else(|_| config.log_level.clone()),
        1 => "info".into(),
        _ => "debug".into(),
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .try_init();
}

fn run(cli: Cli) -> Result<(), Error> {
    // Making a secret needs no configuration (and must not fail on a broken one).
    if let Command::Agent(args) = &cli.command
        && args.is_keygen()
    {
        return agent::keygen(args);
    }
    let mut config = Config::load(cli.config.as_deref())?;
    if let Some(b) = cli.backend {
        config.backend = b;
    }
    init_logging(&config, cli.verbose);
    if let Some(addr) = cli.metrics_addr {
        stat::serve(addr)?;
    }
    let result = match cli.command {
        Command::Info(args) => info::run(config, &args),
        Command::Cp(args) => cp::run(config, &args),
        #[cfg(feature = "bench")]
        Command::Bench(args) => bench::run(config, &args),
        Command::Stat(args) => stat::run(&args),
        Command::Agent(args) => agent::run(config, &args),
        #[cfg(feature = "nixl")]
        Command::NixlExport(args) => nixl::run(config, &args),
    };
    if cli.metrics_addr.is_some() && !cli.metrics_linger.is_zero() {
        std::thread::sleep(cli.metrics_linger);
    }
    result
}

/// Parses the command line. A usage error quotes what was given, so it is printed with its
/// control characters escaped (line by line: clap's own layout keeps its lines); help and
/// version go out as clap writes them.
fn parse_command_line() -> Result<Cli, ExitCode> {
    use clap::error::ErrorKind;
    Cli::try_parse().map_err(|e| {
        if matches!(
            e.kind(),
            ErrorKind::DisplayHelp
                | ErrorKind::DisplayVersion
                | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
        ) {
            e.exit();
        }
        // Display renders without styling, so no escape sequence is ours to keep.
        let text = e.render().to_string();
        let lines: Vec<_> = text.split('\n').map(gpuio_api::escape).collect();
        eprint!("{}", lines.join("\n"));
        ExitCode::from(e.exit_code().clamp(0, 255) as u8)
    })
}

fn main() -> ExitCode {
    let cli = match parse_command_line() {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let code = e.code();
            eprintln!("gpuio: error: {e} [{}]", code.name());
            ExitCode::from(code.as_i32().unsigned_abs().min(255) as u8)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn the_command_line_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn commands_parse() {
        let cli =
            Cli::try_parse_from(["gpuio", "cp", "a", "gpu0", "--via", "gpu0", "--verify"]).unwrap();
        assert!(matches!(cli.command, Command::Cp(_)));
        let cli =
            Cli::try_parse_from(["gpuio", "--backend", "host", "info", "--show-config"]).unwrap();
        assert_eq!(cli.backend, Some(BackendPreference::Host));
        assert!(Cli::try_parse_from(["gpuio", "--backend", "opencl", "info"]).is_err());
        assert!(
            Cli::try_parse_from(["gpuio", "bench", "memio", "--quick", "--sizes", "4K,1M"]).is_ok()
        );
    }

    #[test]
    fn waits_are_checked_when_parsed() {
        let linger = |v: &str| {
            Cli::try_parse_from(["gpuio", "--metrics-linger", v, "info"])
                .map(|c| c.metrics_linger)
                .map_err(|e| e.to_string())
        };
        assert_eq!(linger("2.5"), Ok(std::time::Duration::from_millis(2500)));
        assert_eq!(linger("0"), Ok(std::time::Duration::ZERO));
        for bad in ["inf", "1e300", "-1", "NaN", "-0.5", "86401", "soon"] {
            let e = linger(bad).unwrap_err();
            assert!(e.contains("--metrics-linger"), "{bad}: {e}");
        }
        let watch = |v: &str| Cli::try_parse_from(["gpuio", "stat", "--watch", v]).is_ok();
        assert!(watch("0.5"));
        assert!(!watch("inf") && !watch("NaN") && !watch("-2"));
    }
}
