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

use crate::error::{Error, Result};
use crate::session::Session;
use gpuio_hal::HalError;
use gpuio_hal::sync::MutexExt;
use gpuio_transport_localio::{FileHandle, OpenOptions};
use std::ffi::OsStr;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

const SUFFIX: &str = ".gpuio-partial";

/// The partial files this process is writing now (what a signal handler must remove).
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

/// A destination file being written under a temporary name: created exclusively with a random
/// name in the destination's directory (no symlink or concurrent copy can be written through
/// it), removed if the copy fails, renamed over the destination when it succeeds.
pub(crate) struct PendingFile {
    pub(crate) handle: FileHandle,
    temp: Option<tempfile::TempPath>,
    /// Holds the partial file's `flock` while the copy runs.
    _lock: Option<std::fs::File>,
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
            gpuio_transport_localio::LocalIoError::Open {
                path: target.to_path_buf(),
                source: e,
            }
            .into()
        };
        let temp = tempfile::Builder::new()
            .prefix(&format!(".{}.", name.to_string_lossy()))
            .suffix(SUFFIX)
            // Like any new file: 0666 less the umask; a replaced file keeps its mode.
            .permissions(std::fs::Permissions::from_mode(0o666))
            .tempfile_in(dir)
            .map_err(io_err)?;
        let (file, path) = temp.into_parts();
        // Locked before anyone else can see it unlocked, for as long as the copy runs.
        let lock = file.try_clone().map_err(io_err)?;
        lock.try_lock().map_err(|e| io_err(e.into()))?;
        ours().push(path.to_path_buf());
        let uid = lock.metadata().map_err(io_err)?.uid();
        remove_abandoned(dir, name, uid);
        if let Some(meta) = &existing {
            file.set_permissions(meta.permissions()).map_err(io_err)?;
        }
        let handle = if opts.direct || opts.gds.is_some() {
            // Reopened with the flags asked for; `path` deletes the file if that fails.
            session.open_file(&path, opts)?
        } else {
            FileHandle::from_file(file, path.to_path_buf(), true)
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
