//! Destination files written under a temporary name beside the destination and renamed
//! over it only when complete, so a failed copy never leaves a partial file under the
//! destination's name.
//!
//! A partial file is named `.<name>.<host>-<pid>.<random>.gpuio-partial`. It is removed when
//! its copy fails, and by `gpuio cp` when SIGINT, SIGTERM or SIGHUP interrupts it
//! ([`discard_partial_copies`]). SIGKILL leaves it behind; the next copy to the same
//! destination removes it, having checked that its process (on this host) is gone.

use crate::error::{Error, Result};
use crate::session::Session;
use gpuio_transport_localio::{FileHandle, OpenOptions};
use std::ffi::OsStr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

const SUFFIX: &str = ".gpuio-partial";

/// This host's name, as partial files carry it (a PID means nothing on another host).
fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().replace(['.', '/'], "_"))
        .unwrap_or_default()
}

/// The start of the names of this process's partial files for destination file `name`.
fn own_prefix(name: &OsStr) -> String {
    format!(
        ".{}.{}-{}.",
        name.to_string_lossy(),
        host(),
        std::process::id()
    )
}

/// The directory a destination path lies in.
fn parent_of(target: &Path) -> &Path {
    match target.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Removes this process's partial files for `target` (what an interrupted `gpuio cp` leaves);
/// returns how many it removed.
pub fn discard_partial_copies(target: &Path) -> usize {
    let Some(name) = target.file_name() else {
        return 0;
    };
    let prefix = own_prefix(name);
    remove_where(parent_of(target), |file| {
        file.starts_with(&prefix) && file.ends_with(SUFFIX)
    })
}

/// Removes the partial files for destination `name` in `dir` whose copies are gone: written
/// on this host by a process that no longer runs.
fn remove_abandoned(dir: &Path, name: &OsStr) -> usize {
    let prefix = format!(".{}.{}-", name.to_string_lossy(), host());
    remove_where(dir, |file| {
        let Some(pid) = file
            .strip_prefix(&prefix)
            .and_then(|rest| rest.strip_suffix(SUFFIX))
            .and_then(|rest| rest.split_once('.'))
            .and_then(|(pid, _random)| pid.parse::<u32>().ok())
        else {
            return false;
        };
        pid != std::process::id() && !Path::new("/proc").join(pid.to_string()).exists()
    })
}

fn remove_where(dir: &Path, mut doomed: impl FnMut(&str) -> bool) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(file) = name.to_str() else { continue };
        if doomed(file) && std::fs::remove_file(e.path()).is_ok() {
            tracing::info!(path = %e.path().display(), "removed an abandoned partial copy");
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
        remove_abandoned(dir, name);
        let temp = tempfile::Builder::new()
            .prefix(&own_prefix(name))
            .suffix(SUFFIX)
            // Like any new file: 0666 less the umask; a replaced file keeps its mode.
            .permissions(std::fs::Permissions::from_mode(0o666))
            .tempfile_in(dir)
            .map_err(io_err)?;
        let (file, path) = temp.into_parts();
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
            target: target.into(),
        })
    }

    /// Renames the finished file over the destination; with `durable`, also makes the rename
    /// itself durable (fsync of the directory).
    pub(crate) fn commit(mut self, durable: bool) -> Result<FileHandle> {
        if let Some(temp) = self.temp.take() {
            temp.persist(&self.target).map_err(|e| {
                Error::Invalid(format!(
                    "renaming into {}: {}",
                    self.target.display(),
                    e.error
                ))
            })?;
            if durable {
                let dir = parent_of(&self.target);
                std::fs::File::open(dir)
                    .and_then(|d| d.sync_all())
                    .map_err(|e| Error::Invalid(format!("syncing {}: {e}", dir.display())))?;
            }
        }
        Ok(self.handle.clone())
    }
}
