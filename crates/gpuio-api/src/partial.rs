//! Destination files written under a temporary name beside the destination and renamed
//! over it only when complete, so a failed copy never leaves a partial file under the
//! destination's name.
//!
//! A partial file is named `.<name>.<random>.gpuio-partial` and, for as long as its copy
//! runs, holds an exclusive `flock` on it. It is removed when its copy fails, and by
//! `gpuio cp` when SIGINT, SIGTERM or SIGHUP interrupts it ([`discard_partial_copies`]).
//! SIGKILL leaves it behind, unlocked (the kernel drops a dead process's locks); the next copy
//! to the same destination removes partial files of that destination that belong to the same
//! user and that nobody holds locked — which no process id, host name or PID namespace can
//! get wrong.
//!
//! So that no copy's cleanup can take a partial file for abandoned before it is locked, it is
//! created exclusively as `.<name>.<random>.gpuio-creating`, a name the cleanup never
//! touches, locked, and only then renamed (never over an existing file) to its
//! `.gpuio-partial` name; the lock belongs to the open file, so the rename keeps it. A copy
//! killed by SIGKILL in that instant leaves a `.gpuio-creating` file behind for the user.

use crate::error::{Error, Result};
use crate::session::Session;
use gpuio_hal::HalError;
use gpuio_hal::sync::MutexExt;
use gpuio_transport_localio::{FileHandle, LocalIoError, OpenOptions};
use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use tempfile::TempPath;

const SUFFIX: &str = ".gpuio-partial";
/// A partial file's name until it is locked: no cleanup looks at it.
const CREATING: &str = ".gpuio-creating";
/// New random names tried when a locked file's `.gpuio-partial` name is taken.
const ATTEMPTS: u32 = 8;

/// The partial files this process is writing now, under whichever name each has (what a
/// signal handler must remove).
static OURS: Mutex<Vec<PathBuf>> = Mutex::new(Vec::new());

fn ours() -> std::sync::MutexGuard<'static, Vec<PathBuf>> {
    OURS.lock_unpoisoned()
}

/// The directory a destination path lies in.
fn parent_of(target: &Path) -> &Path {
    match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Removes the partial files of the copies this process is making (what an interrupted
/// `gpuio cp` leaves); returns how many it removed. Safe to call from a signal-handling
/// thread: it takes a lock no copy holds for long.
pub fn discard_partial_copies() -> usize {
    ours()
        .drain(..)
        .filter(|p| std::fs::remove_file(p).is_ok())
        .count()
}

/// Removes the partial files for destination `name` in `dir` whose copies are gone: named as
/// this module names them, owned by `uid`, regular, and held locked by nobody.
fn remove_abandoned(dir: &Path, name: &OsStr, uid: u32) -> usize {
    let prefix = format!(".{}.", name.to_string_lossy());
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let file = e.file_name();
        let Some(random) = file
            .to_str()
            .and_then(|f| f.strip_prefix(&prefix))
            .and_then(|f| f.strip_suffix(SUFFIX))
        else {
            continue;
        };
        // The random part has no dots: `.model.x.AbC123.gpuio-partial` belongs to `model.x`.
        if random.is_empty() || !random.bytes().all(|b| b.is_ascii_alphanumeric()) {
            continue;
        }
        let path = e.path();
        let Ok(f) = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
            .open(&path)
        else {
            continue;
        };
        let abandoned =
            f.metadata().is_ok_and(|m| m.is_file() && m.uid() == uid) && f.try_lock().is_ok();
        if abandoned && std::fs::remove_file(&path).is_ok() {
            tracing::info!(path = %path.display(), "removed an abandoned partial copy");
            removed += 1;
        }
    }
    removed
}

/// Creates a partial file for destination `name` in `dir`, locked before it has the name the
/// cleanup looks for. Returns it, a second handle holding its lock, and its path; the path is
/// in [`OURS`], under whichever name the file has, for as long as it exists.
fn create_locked(dir: &Path, name: &OsStr) -> std::io::Result<(File, File, TempPath)> {
    let prefix = format!(".{}.", name.to_string_lossy());
    let forget = |at: &Path, list: &mut Vec<PathBuf>| list.retain(|p| p != at);
    let mut attempt = 0;
    loop {
        attempt += 1;
        let (file, creating) = tempfile::Builder::new()
            .prefix(&prefix)
            .suffix(CREATING)
            .make_in(dir, |path| {
                // Listed as it is created, so that a signal finds it from the start.
                let mut list = ours();
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    // Like any new file: 0666 less the umask; a replaced file keeps its mode.
                    .mode(0o666)
                    .open(path)?;
                list.push(path.to_path_buf());
                Ok(f)
            })?
            .into_parts();
        let locked = file
            .try_clone()
            .and_then(|l| l.try_lock().map(|()| l).map_err(std::io::Error::from));
        let partial = creating
            .to_str()
            .and_then(|p| p.strip_suffix(CREATING))
            .map(|p| PathBuf::from(format!("{p}{SUFFIX}")));
        let (lock, partial) = match (locked, partial) {
            (Ok(lock), Some(partial)) => (lock, partial),
            (Err(e), _) => {
                forget(&creating, &mut ours());
                return Err(e);
            }
            (_, None) => {
                forget(&creating, &mut ours());
                return Err(std::io::Error::other("a partial file's path is not UTF-8"));
            }
        };
        // The list stays locked across the rename: a signal sees the file under its name.
        let mut list = ours();
        let at = creating.to_path_buf();
        forget(&at, &mut list);
        // On failure, the error's TempPath removes the file under its creating name.
        match creating.persist_noclobber(&partial) {
            Ok(()) => {}
            Err(e) if e.error.kind() == std::io::ErrorKind::AlreadyExists => {
                // Another file has that name (the random parts collided): try another.
                drop(e.path);
                if attempt < ATTEMPTS {
                    continue;
                }
                return Err(e.error);
            }
            // Neither RENAME_NOREPLACE nor hard links here: a plain rename, which could replace
            // a file only if the random parts collided.
            Err(e) => e.path.persist(&partial).map_err(|e| e.error)?,
        }
        // An absolute path (tempfile made it so): taking it cannot fail in practice.
        let partial = TempPath::try_from_path(partial.clone()).inspect_err(|_| {
            let _ = std::fs::remove_file(&partial);
        })?;
        list.push(partial.to_path_buf());
        return Ok((file, lock, partial));
    }
}

/// A destination file being written under a temporary name: created exclusively with a random
/// name in the destination's directory (no symlink or concurrent copy can be written through
/// it), removed if the copy fails, renamed over the destination when it succeeds.
pub(crate) struct PendingFile {
    pub(crate) handle: FileHandle,
    temp: Option<tempfile::TempPath>,
    /// Holds the partial file's `flock` while the copy runs.
    _lock: Option<File>,
    target: PathBuf,
}

impl PendingFile {
    /// A temporary file beside `target`, opened for writing with `opts` (O_DIRECT, GDS).
    pub(crate) fn create(session: &Session, target: &Path, opts: OpenOptions) -> Result<Self> {
        let existing = std::fs::metadata(target).ok();
        // Block devices and other special files are written in place, never replaced.
        if let Some(meta) = &existing
            && !meta.is_file()
        {
            let handle = session.open_file(target, opts)?;
            return Ok(Self {
                handle,
                temp: None,
                _lock: None,
                target: target.into(),
            });
        }
        let name = target
            .file_name()
            .ok_or_else(|| Error::Invalid(format!("{} names no file", target.display())))?;
        let dir = parent_of(target);
        let io_err = |e: std::io::Error| -> Error {
            LocalIoError::Open {
                path: target.to_path_buf(),
                source: e,
            }
            .into()
        };
        let (file, lock, path) = create_locked(dir, name).map_err(io_err)?;
        let opened = (|| {
            let uid = lock.metadata().map_err(io_err)?.uid();
            remove_abandoned(dir, name, uid);
            if let Some(meta) = &existing {
                file.set_permissions(meta.permissions()).map_err(io_err)?;
            }
            if opts.direct || opts.gds.is_some() {
                // Reopened with the flags asked for.
                session.localio().open(&path, opts).map_err(|e| match e {
                    LocalIoError::Open { source, .. } => io_err(source),
                    other => other.into(),
                })
            } else {
                Ok(FileHandle::from_file(file, path.to_path_buf(), true))
            }
        })();
        let handle = match opened {
            // Its errors (a full disk, say) name the destination the user gave, not the partial.
            Ok(h) => h.with_name(target),
            Err(e) => {
                let at = path.to_path_buf();
                drop(path); // removes the file
                ours().retain(|p| *p != at);
                return Err(e);
            }
        };
        Ok(Self {
            handle,
            temp: Some(path),
            _lock: Some(lock),
            target: target.into(),
        })
    }

    /// Renames the finished file over the destination; with `durable`, also makes the rename
    /// itself durable (fsync of the directory).
    pub(crate) fn commit(mut self, durable: bool) -> Result<FileHandle> {
        if let Some(temp) = self.temp.take() {
            let at = temp.to_path_buf();
            let renamed = temp.persist(&self.target);
            ours().retain(|p| *p != at);
            renamed.map_err(|e| HalError::Os {
                op: "rename a finished copy over its destination",
                source: e.error,
            })?;
            if durable {
                std::fs::File::open(parent_of(&self.target))
                    .and_then(|d| d.sync_all())
                    .map_err(|source| HalError::Os {
                        op: "sync the destination's directory",
                        source,
                    })?;
            }
        }
        Ok(self.handle.clone())
    }
}

impl Drop for PendingFile {
    fn drop(&mut self) {
        // An uncommitted copy's file goes with it (TempPath removes it); so does its entry.
        if let Some(temp) = &self.temp {
            let at: &Path = temp;
            ours().retain(|p| p != at);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Config;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    fn session() -> Session {
        Session::new(Config::default()).unwrap()
    }

    const WRITE: OpenOptions = OpenOptions {
        write: true,
        ..OpenOptions::READ
    };

    /// The names in `dir` that end with `suffix`.
    fn named(dir: &Path, suffix: &str) -> Vec<String> {
        std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(suffix))
            .collect()
    }

    #[test]
    fn a_file_being_created_is_never_taken_for_abandoned() {
        let dir = tempfile::tempdir().unwrap();
        // Unlocked, as a new partial is for an instant before its lock: never removed.
        let creating = dir.path().join(".model.AbC123.gpuio-creating");
        std::fs::write(&creating, b"partial").unwrap();
        let uid = std::fs::metadata(dir.path()).unwrap().uid();
        assert_eq!(remove_abandoned(dir.path(), OsStr::new("model"), uid), 0);
        assert!(creating.exists());

        // A pending file has its partial name (listed for the signal handler), locked, and
        // errors name its destination.
        let target = dir.path().join("model");
        let p = PendingFile::create(&session(), &target, WRITE).unwrap();
        let at = p.handle.path().to_path_buf();
        let file = at.file_name().unwrap().to_str().unwrap();
        assert!(
            file.starts_with(".model.") && file.ends_with(SUFFIX),
            "{file}"
        );
        assert_eq!(p.handle.name(), target);
        assert!(ours().contains(&at));
        assert!(
            !ours()
                .iter()
                .any(|p| p.to_string_lossy().ends_with(CREATING))
        );
        assert_eq!(
            named(dir.path(), CREATING),
            [".model.AbC123.gpuio-creating"]
        );
        assert_eq!(remove_abandoned(dir.path(), OsStr::new("model"), uid), 0);
        assert!(at.exists());
        drop(p);
        assert!(!at.exists());
        assert!(!ours().contains(&at));
    }

    #[test]
    fn a_full_disk_is_reported_for_the_destination() {
        let dir = tempfile::tempdir().unwrap();
        let Some(fs) = gpuio_testkit::Tmpfs::mount("1m") else {
            return;
        };
        let small = fs.path();
        let src = dir.path().join("src");
        std::fs::write(&src, vec![7u8; 3 << 20]).unwrap();
        let target = small.join("dest");
        let file = |path: &Path| crate::Uri::File {
            path: path.into(),
            direct: false,
            gds: None,
        };
        let e = session()
            .copy(
                &file(&src),
                &file(&target),
                &Default::default(),
                &mut |_| {},
            )
            .unwrap_err();
        let shown = e.to_string();
        assert!(shown.contains("no space left"), "{shown}");
        assert!(shown.contains(&target.display().to_string()), "{shown}");
        assert!(!shown.contains(SUFFIX), "{shown}");
        // Nothing is left behind: no destination, no partial file.
        assert!(!target.exists());
        assert!(named(small, "").is_empty(), "{:?}", named(small, ""));
    }

    #[test]
    fn concurrent_copies_to_one_destination_all_commit() {
        const THREADS: usize = 8;
        const ROUNDS: usize = 50;
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("dest");
        let uid = std::fs::metadata(dir.path()).unwrap().uid();
        let session = Arc::new(session());
        let done = Arc::new(AtomicBool::new(false));
        // Cleanups of copies that start meanwhile, as fast as they can go.
        let cleaners: Vec<_> = (0..2)
            .map(|_| {
                let (dir, done) = (dir.path().to_path_buf(), done.clone());
                std::thread::spawn(move || {
                    while !done.load(Ordering::Relaxed) {
                        remove_abandoned(&dir, OsStr::new("dest"), uid);
                    }
                })
            })
            .collect();
        let writers: Vec<_> = (0..THREADS)
            .map(|t| {
                let (session, target) = (session.clone(), target.clone());
                std::thread::spawn(move || {
                    let mut failures = Vec::new();
                    for round in 0..ROUNDS {
                        let body = format!("writer {t} round {round}");
                        let result = PendingFile::create(&session, &target, WRITE).and_then(|p| {
                            p.handle.write_all_at(0, body.as_bytes())?;
                            p.commit(false)
                        });
                        if let Err(e) = result {
                            failures.push(format!("writer {t} round {round}: {e}"));
                        }
                    }
                    failures
                })
            })
            .collect();
        let failures: Vec<String> = writers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect();
        done.store(true, Ordering::Relaxed);
        for c in cleaners {
            c.join().unwrap();
        }
        assert!(
            failures.is_empty(),
            "{} failed: {failures:#?}",
            failures.len()
        );
        let got = std::fs::read_to_string(&target).unwrap();
        assert!(got.starts_with("writer "), "{got}");
        assert!(named(dir.path(), SUFFIX).is_empty());
        assert!(named(dir.path(), CREATING).is_empty());
    }

    #[test]
    fn only_abandoned_partials_of_the_same_destination_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        let at = |n: &str| dir.path().join(n);
        for n in [
            ".model.AbC123.gpuio-partial",   // abandoned: removed
            ".model.Live99.gpuio-partial",   // locked by a running copy: kept
            ".model.x.Zz0000.gpuio-partial", // another destination's (model.x): kept
            ".model.AbC123.gpuio-partial.keep",
        ] {
            std::fs::write(at(n), b"partial").unwrap();
        }
        // A link named like a partial is never followed (nor removed).
        std::os::unix::fs::symlink(at("target"), at(".model.Link00.gpuio-partial")).unwrap();
        std::fs::write(at("target"), b"not ours to remove").unwrap();
        let live = std::fs::File::open(at(".model.Live99.gpuio-partial")).unwrap();
        live.try_lock().unwrap();
        let uid = std::fs::metadata(dir.path()).unwrap().uid();
        assert_eq!(remove_abandoned(dir.path(), OsStr::new("model"), uid), 1);
        assert!(!at(".model.AbC123.gpuio-partial").exists());
        for kept in [
            ".model.Live99.gpuio-partial",
            ".model.x.Zz0000.gpuio-partial",
            ".model.AbC123.gpuio-partial.keep",
            "target",
        ] {
            assert!(at(kept).exists(), "{kept} was removed");
        }
        // Another user's abandoned partial is not ours to remove.
        std::fs::write(at(".model.Other1.gpuio-partial"), b"partial").unwrap();
        assert_eq!(
            remove_abandoned(dir.path(), OsStr::new("model"), uid + 1),
            0
        );
        assert!(at(".model.Other1.gpuio-partial").exists());
        // Once its copy is gone (the lock with it), the live one is abandoned too.
        drop(live);
        assert_eq!(remove_abandoned(dir.path(), OsStr::new("model"), uid), 2);
    }
}
