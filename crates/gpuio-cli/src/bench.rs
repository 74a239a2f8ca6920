//! `gpuio bench [SUITE...]`: runs suites against their peers, prints a table last, writes
//! `<out>/<suite>.json` and `<out>/<suite>.svg`.

use bytesize::ByteSize;
use gpuio_api::{Config, Error, Session};
use gpuio_bench::{
    Budget, Record, Target, ai, cache, gather, kernels, load, localio, memio, nvme, ondemand,
    python, remote, render_table, ring, scheduler, write_outputs,
};
use indicatif::ProgressBar;
use std::path::PathBuf;

/// The suites this build has.
const SUITES: &[&str] = &[
    memio::SUITE,
    localio::SUITE,
    scheduler::SUITE,
    gather::SUITE,
    ring::SUITE,
    ondemand::SUITE,
    nvme::SUITE,
    remote::SUITE,
    cache::SUITE,
    kernels::SUITE,
    python::SUITE,
    load::SUITE,
    ai::SUITE,
];

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Suites to run (default: all this build has: memio, localio, core, gather, ring,
    /// ondemand, nvme, remote, cache, kernels, python, load, ai).
    suites: Vec<String>,
    /// memio: transfer sizes, e.g. 4K,1M,64M,1G (default: up to 1 GiB on a GPU).
    #[arg(long, value_name = "LIST")]
    sizes: Option<String>,
    /// localio: size of the test file (default: 4 GiB on a GPU, 256 MiB without).
    #[arg(long, value_name = "SIZE")]
    size: Option<ByteSize>,
    /// Directory for the test files (localio, core, ring, cache, python, load, ai; default: the temporary
    /// directory).
    #[arg(long, value_name = "DIR")]
    scratch: Option<PathBuf>,
    /// Shorter measurements (smoke runs, CI).
    #[arg(long)]
    quick: bool,
    /// localio: the parts to run, of device, host, second-read and cufile (default: all but
    /// cufile, which needs torch, kvikio and gpuio's libcufile.so.0).
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    localio_parts: Option<Vec<String>>,
    /// load: the parts to run, of large, small (the checkpoints), warm and cold (default: all).
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    load_parts: Option<Vec<String>>,
    /// gather: the parts to run, of grid and small (the small calls) (default: all).
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    gather_parts: Option<Vec<String>>,
    /// ai: the parts to run, of b1, b2, b4, b5 and compression (default: all).
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    ai_parts: Option<Vec<String>>,
    /// Directory for the JSON records and plots.
    #[arg(long, default_value = "target/bench", value_name = "DIR")]
    out: PathBuf,
}

fn bench_err(e: gpuio_bench::BenchError) -> Error {
    match e {
        gpuio_bench::BenchError::Gpuio(e) => e,
        other => Error::Invalid(other.to_string()),
    }
}

pub fn run(config: Config, args: &BenchArgs) -> Result<(), Error> {
    let suites: Vec<&str> = if args.suites.is_empty() {
        SUITES.to_vec()
    } else {
        args.suites.iter().map(String::as_str).collect()
    };
    if let Some(bad) = suites.iter().find(|s| !SUITES.contains(s)) {
        return Err(Error::Invalid(format!(
            "unknown suite {bad:?} (this build has: {})",
            SUITES.join(", ")
        )));
    }
    // Shared: the ai suite's background work (B5) runs on side threads.
    let session = std::sync::Arc::new(Session::new(config)?);
    let gpu = session.gpu(0)?;
    eprintln!(
        "gpuio bench on {gpu} ({}){}",
        session.probe().cuda.detail,
        if args.quick { ", quick" } else { "" }
    );
    let budget = if args.quick {
        Budget::quick()
    } else {
        Budget::standard()
    };
    let sizes = match &args.sizes {
        Some(s) => gpuio_bench::parse_sizes(s).map_err(bench_err)?,
        None => memio::default_sizes(gpu.backend()),
    };
    let spinner = ProgressBar::new_spinner();
    let tick = |suite: &str, case: &str| {
        spinner.set_message(format!("{suite}: {case}"));
        spinner.tick();
    };
    let mut all: Vec<(Vec<Record>, Vec<Target>)> = Vec::new();
    for suite in suites {
        let (records, targets, notes) = match suite {
            memio::SUITE => {
                let (r, t) = memio::run(&session, &sizes, &budget, &mut |c| tick(suite, c))
                    .map_err(bench_err)?;
                (r, t, Vec::new())
            }
            localio::SUITE => {
                let mut opts = localio::Options::for_backend(gpu.backend());
                if let Some(s) = args.size {
                    opts.size = s.as_u64().max(1 << 20);
                }
                if let Some(d) = &args.scratch {
                    opts.scratch = d.clone();
                }
                if args.quick {
                    opts.reps = 2;
                    opts.size = opts.size.min(64 << 20);
                    opts.random_reads = opts.random_reads.min(8192);
                }
                if let Some(parts) = &args.localio_parts {
                    opts.keep_parts(parts).map_err(bench_err)?;
                }
                localio::run(&session, &opts, &mut |c| tick(suite, c)).map_err(bench_err)?
            }
            scheduler::SUITE => {
                let mut opts = if args.quick {
                    scheduler::Options::quick()
                } else {
                    scheduler::Options::default()
                };
                if let Some(d) = &args.scratch {
                    opts.scratch = d.clone();
                }
                scheduler::run(&session, &opts, &mut |c| tick(suite, c)).map_err(bench_err)?
            }
            gather::SUITE => {
                let mut opts = if args.quick || gpu.backend() == gpuio_hal::Backend::Host {
                    gather::Options::quick()
                } else {
                    gather::Options::default()
                };
                if let Some(parts) = &args.gather_parts {
                    opts.keep_parts(parts).map_err(bench_err)?;
                }
                gather::run(&session, &opts, &budget, &mut |c| tick(suite, c)).map_err(bench_err)?
            }
            ring::SUITE => {
                let mut opts = if args.quick {
                    ring::Options::quick()
                } else {
                    ring::Options::default()
                };
                if let Some(d) = &args.scratch {
                    opts.scratch = d.clone();
                }
                ring::run(&session, &opts, &mut |c| tick(suite, c)).map_err(bench_err)?
            }
            nvme::SUITE => {
                let opts = if args.quick {
                    nvme::Options::quick()
                } else {
                    nvme::Options::default()
                };
                nvme::run(&session, &opts, &mut |c| tick(suite, c)).map_err(bench_err)?
            }
            ondemand::SUITE => {
                let mut opts = if args.quick {
                    ondemand::Options::quick()
                } else {
                    ondemand::Options::default()
                };
                if let Some(d) = &args.scratch {
                    opts.scratch = d.clone();
                }
                ondemand::run(&session, &opts, &mut |c| tick(suite, c)).map_err(bench_err)?
            }
            ai::SUITE => {
                let mut opts = if args.quick {
                    ai::Options::quick()
                } else {
                    ai::Options::default()
                };
                if let Some(d) = &args.scratch {
                    opts.scratch = d.clone();
                }
                if let Some(parts) = &args.ai_parts {
                    opts.keep_parts(parts).map_err(bench_err)?;
                }
                ai::run(&session, &opts, &mut |c| tick(suite, c)).map_err(bench_err)?
            }
            remote::SUITE => {
                let opts = if args.quick {
                    remote::Options::quick()
                } else {
                    remote::Options::default()
                };
                remote::run(&session, &opts, &mut |c| tick(suite, c)).map_err(bench_err)?
            }
            cache::SUITE => {
                let mut opts = if args.quick {
                    cache::Options::quick()
                } else {
                    cache::Options::default()
                };
                if let Some(d) = &args.scratch {
                    opts.scratch = d.clone();
                }
                cache::run(&session, &opts, &budget, &mut |c| tick(suite, c)).map_err(bench_err)?
            }
            python::SUITE => {
                let mut opts = python::Options::for_backend(gpu.backend());
                if args.quick {
                    opts = opts.quick();
                }
                if let Some(d) = &args.scratch {
                    opts.scratch = d.clone();
                }
                python::run(&session, &opts, &mut |c| tick(suite, c)).map_err(bench_err)?
            }
            load::SUITE => {
                let mut opts = load::Options::standard();
                if args.quick {
                    opts = opts.quick();
                }
                if let Some(d) = &args.scratch {
                    opts.scratch = d.clone();
                }
                if let Some(parts) = &args.load_parts {
                    opts.keep_parts(parts).map_err(bench_err)?;
                }
                load::run(&session, &opts, &mut |c| tick(suite, c)).map_err(bench_err)?
            }
            kernels::SUITE => {
                let opts = if args.quick {
                    kernels::Options::quick()
                } else {
                    kernels::Options::default()
                };
                kernels::run(&session, &opts, &mut |c| tick(suite, c)).map_err(bench_err)?
            }
            _ => continue,
        };
        for n in &notes {
            eprintln!("note: {n}");
        }
        let files =
            write_outputs(&args.out, suite, &records, &targets, &notes).map_err(bench_err)?;
        for f in files {
            eprintln!("wrote {}", f.display());
        }
        all.push((records, targets));
    }
    spinner.finish_and_clear();
    for (records, targets) in &all {
        print!("{}", render_table(records, targets));
    }
    Ok(())
}
