//! `gpuio bench [SUITE...]`: runs suites against their peers, prints a table last, writes
//! `<out>/<suite>.json` and `<out>/<suite>.svg`.

use gpuio_api::{Config, Error, Session};
use gpuio_bench::{Budget, Record, Target, memio, render_table, write_outputs};
use indicatif::ProgressBar;
use std::path::PathBuf;

/// The suites this build has.
const SUITES: &[&str] = &[memio::SUITE];

#[derive(Debug, clap::Args)]
pub struct BenchArgs {
    /// Suites to run (default: all this build has: memio).
    suites: Vec<String>,
    /// Transfer sizes, e.g. 4K,1M,64M,1G (default: the suite's, up to 1 GiB on a GPU).
    #[arg(long, value_name = "LIST")]
    sizes: Option<String>,
    /// Shorter measurements (smoke runs, CI).
    #[arg(long)]
    quick: bool,
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
    let session = Session::new(config)?;
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
    let mut all: Vec<(Vec<Record>, Vec<Target>)> = Vec::new();
    for suite in suites {
        let (records, targets) = match suite {
            memio::SUITE => memio::run(&session, &sizes, &budget, &mut |case| {
                spinner.set_message(format!("{suite}: {case}"));
                spinner.tick();
            })
            .map_err(bench_err)?,
            _ => continue,
        };
        let files = write_outputs(&args.out, suite, &records, &targets).map_err(bench_err)?;
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
