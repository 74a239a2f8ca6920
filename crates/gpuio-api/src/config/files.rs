//! Reading the files a configuration names: configuration files and key secrets are read only
//! when they are small regular files (a FIFO would block the reader forever, a device such as
//! `/dev/zero` never end), secrets only when private to their owner.

use super::MAX_SECRET_BYTES;
use std::path::Path;

/// A key's secret, from exactly one of an environment variable and a file (whose trailing
/// newline is dropped). The file must be a regular file of at most [`MAX_SECRET_BYTES`] that
/// only its owner can read or write, as ssh requires of private keys.
pub(super) fn read_secret(
    key: &str,
    env: Option<&str>,
    file: Option<&Path>,
) -> std::result::Result<Vec<u8>, String> {
    match (env, file) {
        (Some(var), None) => std::env::var(var)
            .map(String::into_bytes)
            .map_err(|_| format!("key {key:?}: ${var} is not set")),
        (None, Some(path)) => {
            let mut bytes = read_small_file(path, MAX_SECRET_BYTES, "secret files", true)
                .map_err(|e| format!("key {key:?}: {}: {e}", path.display()))?;
            while bytes.last().is_some_and(|b| *b == b'\n' || *b == b'\r') {
                bytes.pop();
            }
            Ok(bytes)
        }
        _ => Err(format!(
            "key {key:?}: give exactly one of secret_env, secret_file"
        )),
    }
}

/// What a file is, for an error that refuses it.
fn file_kind(t: std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else if t.is_dir() {
        "a directory"
    } else {
        "not a regular file"
    }
}

/// Reads a regular file of at most `cap` bytes (`what` names such files in the error). A
/// special file is refused before it is opened (opening a device can have effects of its
/// own); the open itself does not block (O_NONBLOCK: a FIFO swapped in meanwhile would wait
/// for a writer forever) and its type is checked again on the open file. A `private` file
/// (a secret) must not be readable or writable by group or others.
pub(super) fn read_small_file(
    path: &Path,
    cap: u64,
    what: &str,
    private: bool,
) -> std::result::Result<Vec<u8>, String> {
    use std::io::Read;
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let regular = |meta: &std::fs::Metadata| {
        if meta.is_file() {
            Ok(())
        } else {
            Err(format!(
                "is {}, and {what} must be regular files",
                file_kind(meta.file_type())
            ))
        }
    };
    regular(&std::fs::metadata(path).map_err(|e| e.to_string())?)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
        .map_err(|e| e.to_string())?;
    let meta = file.metadata().map_err(|e| e.to_string())?;
    regular(&meta)?;
    if private {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(format!(
                "is readable or writable by others (mode {mode:04o}): {what} must be private \
                 to their owner; run `chmod 600 {}`",
                path.display()
            ));
        }
    }
    if meta.len() > cap {
        return Err(format!(
            "is {} bytes; {what} are at most {cap} bytes",
            meta.len()
        ));
    }
    let mut bytes = Vec::new();
    // The size can change after the check: never read more than the cap.
    file.take(cap + 1)
        .read_to_end(&mut bytes)
        .map_err(|e| e.to_string())?;
    if bytes.len() as u64 > cap {
        return Err(format!(
            "is larger than {cap} bytes, the most {what} may be"
        ));
    }
    Ok(bytes)
}
