//! Reading small files whole (certificates, keys, secrets, configuration) without being hung
//! or flooded: a FIFO blocks its reader forever and a device such as `/dev/zero` never ends,
//! so only small regular files are read. gpuio-api reads its configuration and secret files
//! through this too, so that the rule is kept in one place.

use std::path::Path;

/// What a file that is not a regular file is, for the error that refuses it.
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

/// Reads a small regular file whole: at most `cap` bytes (`what` names such files in the
/// errors, as in "TLS private keys"). A special file is refused before it is opened, since a
/// FIFO blocks its reader forever, a device such as `/dev/zero` never ends, and opening a
/// device can have effects of its own. The open does not block (O_NONBLOCK: a FIFO swapped in
/// meanwhile would wait for a writer forever) and the type is checked again on the open file.
/// A `private` file (a secret, a private key) must not be readable or writable by group or
/// others, as ssh requires of private keys. The errors' messages say what is wrong and, where
/// there is one, the fix; they do not repeat the path.
pub fn read_small_file(
    path: &Path,
    cap: u64,
    what: &str,
    private: bool,
) -> std::io::Result<Vec<u8>> {
    use std::io::{Error, ErrorKind, Read};
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let regular = |meta: &std::fs::Metadata| {
        if meta.is_file() {
            Ok(())
        } else {
            Err(Error::new(
                ErrorKind::InvalidInput,
                format!(
                    "is {}, and {what} must be regular files",
                    file_kind(meta.file_type())
                ),
            ))
        }
    };
    regular(&std::fs::metadata(path)?)?;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let meta = file.metadata()?;
    regular(&meta)?;
    if private {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(Error::new(
                ErrorKind::PermissionDenied,
                format!(
                    "is readable or writable by others (mode {mode:04o}): {what} must be \
                     private to their owner; run `chmod 600 {}`",
                    path.display()
                ),
            ));
        }
    }
    let too_large = |size: String| {
        Error::new(
            ErrorKind::InvalidData,
            format!("{size}; {what} are at most {cap} bytes"),
        )
    };
    if meta.len() > cap {
        return Err(too_large(format!("is {} bytes", meta.len())));
    }
    let mut bytes = Vec::new();
    // The size can change after the check: never read more than the cap.
    file.take(cap.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > cap {
        return Err(too_large("grew while it was read".into()));
    }
    Ok(bytes)
}
