//! `cargo xtask fuzz [TARGET].. [--time S] [--jobs N] [--keep]`: the fuzz targets of `fuzz/`
//! under AFL++, through cargo-afl (installed from crates.io when missing: it builds AFL++ from
//! the sources it ships, on the stable toolchain). Each target starts from its committed corpus
//! and its seeds and runs for S seconds (default 60), in N afl-fuzz instances side by side
//! (one main, N-1 secondaries sharing its queue; one per core). A crash or hang is copied into
//! `fuzz/regressions/TARGET/`, where the replay test runs it, and fails the task.
//!
//! With `--keep`, what the run found is minimized into `fuzz/corpus/TARGET/` (`afl-cmin`)
//! and the run's executions are added to `fuzz/executions.toml`, the tally of executions each
//! target has had over all kept runs.
//!
//! `--coverage` fuzzes nothing: it replays the committed corpora under rustc's source-based
//! coverage and reports, per target, the lines of its parsers' sources they reach (LLVM 19's
//! llvm-profdata and llvm-cov read what rustc 1.95 writes; Debian's llvm-19, installed when
//! missing).

use crate::{Result, cargo, has, root, run};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The cargo-afl release the driver installs: its AFL++ is the one the corpora were grown with.
const CARGO_AFL: &str = "0.18.2";

/// How long one input may run before AFL++ calls it a hang, in milliseconds.
const HANG_MS: &str = "2000";

struct Options {
    targets: Vec<String>,
    seconds: u64,
    jobs: usize,
    keep: bool,
    coverage: bool,
}

fn options(args: &[String]) -> Result<Options> {
    let mut o = Options {
        targets: Vec::new(),
        seconds: 60,
        jobs: 1,
        keep: false,
        coverage: false,
    };
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "--time" => {
                let s = it.next().ok_or("--time needs a number of seconds")?;
                o.seconds = s
                    .parse()
                    .ok()
                    .filter(|&s| s > 0)
                    .ok_or(format!("--time {s}: not a number of seconds"))?;
            }
            "--jobs" => {
                let n = it.next().ok_or("--jobs needs a number of instances")?;
                o.jobs = n
                    .parse()
                    .ok()
                    .filter(|&n| (1..=64).contains(&n))
                    .ok_or(format!("--jobs {n}: not a number of instances (1 to 64)"))?;
            }
            "--keep" => o.keep = true,
            "--coverage" => o.coverage = true,
            flag if flag.starts_with('-') => return Err(format!("unknown option {flag}")),
            name => o.targets.push(name.to_owned()),
        }
    }
    Ok(o)
}

pub fn fuzz(args: &[String]) -> Result {
    let o = options(args)?;
    ensure_cargo_afl()?;
    let dir = root().join("target/fuzz");
    run(
        "cargo afl build (gpuio-fuzz)",
        cargo()
            .args([
                "afl",
                "build",
                "--release",
                "-p",
                "gpuio-fuzz",
                "--features",
                "afl",
            ])
            .arg("--target-dir")
            .arg(dir.join("build")),
    )?;
    let bin = dir.join("build/release/gpuio-fuzz");
    let all = target_names(&bin)?;
    let targets = if o.targets.is_empty() {
        all
    } else {
        for t in &o.targets {
            if !all.contains(t) {
                return Err(format!("no fuzz target {t} (targets: {})", all.join(", ")));
            }
        }
        o.targets.clone()
    };
    if o.coverage {
        return coverage(&bin, &targets);
    }
    let mut failed = Vec::new();
    for t in &targets {
        let stats = fuzz_one(&bin, &dir, t, o.seconds, o.jobs)?;
        let found = keep_failures(&dir, t)?;
        // Counts add up over the instances; coverage and paths are the main instance's.
        let sum = |key: &str| -> f64 {
            stats
                .iter()
                .filter_map(|s| s.get(key)?.parse::<f64>().ok())
                .sum()
        };
        let main = |key: &str| stats[0].get(key).cloned().unwrap_or_else(|| "?".into());
        eprintln!(
            "    {t}: {} executions ({:.0}/s), {} paths, edges {}, {} crashes, {} hangs",
            sum("execs_done"),
            sum("execs_per_sec"),
            main("corpus_count"),
            main("bitmap_cvg"),
            sum("saved_crashes"),
            sum("saved_hangs"),
        );
        if !found.is_empty() {
            failed.push(format!("{t}: {}", found.join(", ")));
        }
        if o.keep {
            minimize(&bin, &dir, t)?;
            let execs = sum("execs_done") as u64;
            // Read, added to and written at once: runs of other targets may go on beside
            // this one.
            let mut tally = read_tally()?;
            *tally.entry(t.clone()).or_default() += execs;
            write_tally(&tally)?;
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "inputs that fail, now in fuzz/regressions: {}",
            failed.join("; ")
        ))
    }
}

/// Installs cargo-afl (which builds AFL++) where `cargo afl` is missing.
fn ensure_cargo_afl() -> Result {
    if Command::new("cargo")
        .args(["afl", "--version"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        return Ok(());
    }
    if !has("make", "--version") {
        return Err("building AFL++ needs make and a C compiler".into());
    }
    run(
        "install cargo-afl (builds AFL++)",
        Command::new("cargo").args(["install", "--locked", "--version", CARGO_AFL, "cargo-afl"]),
    )
}

/// The names the harness knows (its usage line lists them).
fn target_names(bin: &Path) -> Result<Vec<String>> {
    let out = Command::new(bin)
        .output()
        .map_err(|e| format!("{}: {e}", bin.display()))?;
    let usage = String::from_utf8_lossy(&out.stderr);
    let list = usage
        .split_once("(targets: ")
        .and_then(|(_, l)| l.split_once(')'))
        .ok_or(format!("{}: no target list in {usage:?}", bin.display()))?
        .0;
    Ok(list.split(", ").map(str::to_owned).collect())
}

/// One target under `jobs` afl-fuzz instances for `seconds`; each one's `fuzzer_stats`, the
/// main instance's first.
fn fuzz_one(
    bin: &Path,
    dir: &Path,
    t: &str,
    seconds: u64,
    jobs: usize,
) -> Result<Vec<BTreeMap<String, String>>> {
    let input = dir.join("in").join(t);
    let output = dir.join("out").join(t);
    for d in [&input, &output] {
        let _ = std::fs::remove_dir_all(d);
    }
    for d in [&input, &dir.join("out")] {
        std::fs::create_dir_all(d).map_err(|e| format!("{}: {e}", d.display()))?;
    }
    run(
        &format!("seeds of {t}"),
        Command::new(bin).args(["seeds", t]).arg(&input),
    )?;
    let corpus = root().join("fuzz/corpus").join(t);
    for f in files(&corpus)? {
        let name = f.file_name().expect("a file name");
        std::fs::copy(&f, input.join(name)).map_err(|e| format!("{}: {e}", f.display()))?;
    }
    let names: Vec<String> = match jobs {
        1 => vec!["default".into()],
        _ => (0..jobs)
            .map(|i| {
                if i == 0 {
                    "main".into()
                } else {
                    format!("s{i}")
                }
            })
            .collect(),
    };
    let what = format!("afl-fuzz {t} for {seconds} s ({jobs} instances)");
    let start = std::time::Instant::now();
    eprintln!("==> {what}");
    let mut running = Vec::new();
    for (i, name) in names.iter().enumerate() {
        let mut cmd = afl();
        cmd.args(["fuzz", "-i"]).arg(&input).arg("-o").arg(&output);
        if jobs > 1 {
            cmd.args([if i == 0 { "-M" } else { "-S" }, name.as_str()]);
        }
        cmd.args(["-V", &seconds.to_string(), "-t", HANG_MS, "--"])
            .args([bin.as_os_str(), t.as_ref()]);
        running.push(
            cmd.spawn()
                .map_err(|e| format!("{what}: cannot start: {e}"))?,
        );
    }
    let mut failed = Vec::new();
    for (name, mut child) in names.iter().zip(running) {
        match child.wait() {
            Ok(s) if s.success() => {}
            Ok(s) => failed.push(format!("{name}: {s}")),
            Err(e) => failed.push(format!("{name}: {e}")),
        }
    }
    eprintln!(
        "    {what}: {} in {:.1} s",
        if failed.is_empty() { "ok" } else { "FAILED" },
        start.elapsed().as_secs_f64()
    );
    if !failed.is_empty() {
        return Err(format!("{what} failed ({})", failed.join(", ")));
    }
    names
        .iter()
        .map(|name| {
            let stats = std::fs::read_to_string(output.join(name).join("fuzzer_stats"))
                .map_err(|e| format!("{t} ({name}): no fuzzer_stats: {e}"))?;
            Ok(stats
                .lines()
                .filter_map(|l| l.split_once(':'))
                .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
                .collect())
        })
        .collect()
}

/// The output folders of a target's afl-fuzz instances.
fn instances(dir: &Path, t: &str) -> Result<Vec<PathBuf>> {
    let out = dir.join("out").join(t);
    let entries = std::fs::read_dir(&out).map_err(|e| format!("{}: {e}", out.display()))?;
    let mut found: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("fuzzer_stats").is_file())
        .collect();
    found.sort();
    Ok(found)
}

/// `cargo afl` with the settings a container or CI machine needs: no CPU frequency or core
/// dump checks (the machine's, not ours to change), plain output instead of the full-screen
/// UI, the harness's exit on a run's end.
fn afl() -> Command {
    let mut c = cargo();
    c.arg("afl")
        .env("AFL_SKIP_CPUFREQ", "1")
        .env("AFL_I_DONT_CARE_ABOUT_MISSING_CRASHES", "1")
        .env("AFL_NO_UI", "1")
        .env("AFL_TRY_AFFINITY", "1");
    c
}

/// Copies the run's crashes and hangs into `fuzz/regressions/TARGET/`; their names.
fn keep_failures(dir: &Path, t: &str) -> Result<Vec<String>> {
    let keep = root().join("fuzz/regressions").join(t);
    let mut names = Vec::new();
    for (out, kind) in instances(dir, t)?
        .into_iter()
        .flat_map(|out| [(out.clone(), "crashes"), (out, "hangs")])
    {
        // AFL++ leaves a README.txt beside the inputs.
        for f in files(&out.join(kind))?
            .into_iter()
            .filter(|f| !f.ends_with("README.txt"))
        {
            let data = std::fs::read(&f).map_err(|e| format!("{}: {e}", f.display()))?;
            let name = format!("{kind}-{:08x}", crc32c::crc32c(&data));
            std::fs::create_dir_all(&keep).map_err(|e| format!("{}: {e}", keep.display()))?;
            std::fs::write(keep.join(&name), &data).map_err(|e| format!("{name}: {e}"))?;
            names.push(name);
        }
    }
    Ok(names)
}

/// The committed corpus and what the run found, minimized by afl-cmin into the corpus.
fn minimize(bin: &Path, dir: &Path, t: &str) -> Result {
    let pool = dir.join("pool").join(t);
    let _ = std::fs::remove_dir_all(&pool);
    std::fs::create_dir_all(&pool).map_err(|e| format!("{}: {e}", pool.display()))?;
    let corpus = root().join("fuzz/corpus").join(t);
    let mut found = files(&corpus)?;
    for out in instances(dir, t)? {
        found.extend(files(&out.join("queue"))?);
    }
    for (i, f) in found.into_iter().enumerate() {
        std::fs::copy(&f, pool.join(format!("{i:06}")))
            .map_err(|e| format!("{}: {e}", f.display()))?;
    }
    let fresh = dir.join("cmin").join(t);
    let _ = std::fs::remove_dir_all(&fresh);
    // The awk afl-cmin: the Python one of AFL++ 4.40c finds no tuples in a persistent-mode
    // Rust harness.
    let mut cmin = Command::new(afl_tool("afl-cmin.awk")?);
    cmin.env("AFL_SKIP_CPUFREQ", "1");
    run(
        &format!("afl-cmin {t}"),
        cmin.arg("-i")
            .arg(&pool)
            .arg("-o")
            .arg(&fresh)
            .args(["-t", HANG_MS, "--"])
            .args([bin.as_os_str(), t.as_ref()]),
    )?;
    let kept = files(&fresh)?;
    if kept.is_empty() && !files(&pool)?.is_empty() {
        return Err(format!("afl-cmin {t} kept nothing of {}", pool.display()));
    }
    let _ = std::fs::remove_dir_all(&corpus);
    std::fs::create_dir_all(&corpus).map_err(|e| format!("{}: {e}", corpus.display()))?;
    // Named by content, so a corpus that did not change leaves no diff.
    for f in kept {
        let data = std::fs::read(&f).map_err(|e| format!("{}: {e}", f.display()))?;
        std::fs::write(corpus.join(format!("{:08x}", crc32c::crc32c(&data))), &data)
            .map_err(|e| format!("{}: {e}", corpus.display()))?;
    }
    Ok(())
}

/// A tool of the AFL++ that cargo-afl built (under `$XDG_DATA_HOME/afl.rs/rustc-*/`).
fn afl_tool(name: &str) -> Result<PathBuf> {
    let data = std::env::var_os("XDG_DATA_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".local/share")))
        .ok_or("neither XDG_DATA_HOME nor HOME is set")?;
    let builds = data.join("afl.rs");
    std::fs::read_dir(&builds)
        .map_err(|e| format!("{}: {e}", builds.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.path().join(format!("afl.rs-{CARGO_AFL}/afl/bin/{name}")))
        .find(|p| p.exists())
        .ok_or(format!("no {name} under {}", builds.display()))
}

/// The regular files of `dir` (none if it does not exist), in name order.
fn files(dir: &Path) -> Result<Vec<PathBuf>> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Ok(Vec::new());
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_file())
        .collect();
    out.sort();
    Ok(out)
}

fn tally_path() -> PathBuf {
    root().join("fuzz/executions.toml")
}

/// Executions per target over every kept run.
fn read_tally() -> Result<BTreeMap<String, u64>> {
    let Ok(text) = std::fs::read_to_string(tally_path()) else {
        return Ok(BTreeMap::new());
    };
    toml::from_str(&text).map_err(|e| format!("fuzz/executions.toml: {e}"))
}

fn write_tally(tally: &BTreeMap<String, u64>) -> Result {
    let body = toml::to_string(tally).map_err(|e| format!("fuzz/executions.toml: {e}"))?;
    let text = format!(
        "# Executions each fuzz target has had over all kept runs (cargo xtask fuzz --keep).\n{body}"
    );
    std::fs::write(tally_path(), text).map_err(|e| format!("fuzz/executions.toml: {e}"))
}

/// Line coverage of each target's parser sources by the committed corpora and regressions.
fn coverage(bin: &Path, targets: &[String]) -> Result {
    if !has("llvm-cov-19", "--version") {
        crate::ci::ensure_packages(&["llvm-19"])?;
    }
    let dir = root().join("target/fuzz/cov");
    let prof = dir.join("prof");
    let _ = std::fs::remove_dir_all(&prof);
    run(
        "replay the corpora under coverage",
        cargo()
            .args(["test", "-p", "gpuio-fuzz", "--test", "replay"])
            .env("RUSTFLAGS", "-C instrument-coverage")
            .env("CARGO_TARGET_DIR", &dir)
            .env("LLVM_PROFILE_FILE", prof.join("%p-%m.profraw")),
    )?;
    let data = dir.join("replay.profdata");
    run(
        "llvm-profdata merge",
        Command::new("llvm-profdata-19")
            .args(["merge", "-sparse", "-o"])
            .arg(&data)
            .args(files(&prof)?),
    )?;
    // The replay binary just built: the newest `replay-*` executable.
    let replay = files(&dir.join("debug/deps"))?
        .into_iter()
        .filter(|p| {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            name.is_some_and(|n| n.starts_with("replay-") && !n.contains('.'))
        })
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
        .ok_or("no replay binary was built")?;
    for t in targets {
        let out = Command::new(bin)
            .args(["sources", t])
            .output()
            .map_err(|e| format!("{}: {e}", bin.display()))?;
        let sources: Vec<PathBuf> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|s| root().join(s))
            .collect();
        let report = Command::new("llvm-cov-19")
            .arg("report")
            .arg(&replay)
            .arg(format!("-instr-profile={}", data.display()))
            .args(&sources)
            .output()
            .map_err(|e| format!("llvm-cov-19: {e}"))?;
        let text = String::from_utf8_lossy(&report.stdout);
        // TOTAL, regions, missed, %, functions, missed, %, lines, missed lines, %, ...
        let total: Vec<&str> = text
            .lines()
            .find(|l| l.starts_with("TOTAL"))
            .ok_or(format!("{t}: llvm-cov gave no total: {text}"))?
            .split_whitespace()
            .collect();
        let num = |i: usize| {
            total
                .get(i)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
        };
        let (lines, missed) = (num(7), num(8));
        eprintln!(
            "    {t}: {} of {lines} lines of its parsers reached ({:.1}%)",
            lines - missed.min(lines),
            100.0 * (lines - missed.min(lines)) as f64 / lines.max(1) as f64
        );
    }
    Ok(())
}
