//! gpuio-api's error type: every failure a user of the library or the CLI can meet, each
//! mapped to an error code (docs/REFERENCE.md#error-codes).

use gpuio_core::{CoreError, ErrorCode};
use gpuio_hal::HalError;
use gpuio_transport_localio::LocalIoError;
use gpuio_transport_memio::MemIoError;
use std::borrow::Cow;
use std::fmt;
use std::path::Path;

/// `text` with every control character (C0, DEL, C1) and every Unicode bidirectional control
/// written as an escape (`\n`, `\0`, `\x1b`, `\u{202e}`), for printing text taken from a file
/// name, a URI or a configuration: a hostile name then cannot move the cursor, recolour or
/// rewrite a terminal, or hide text. Everything else, backslashes included, is kept, so
/// escaping twice changes nothing.
pub fn escape(text: &str) -> Cow<'_, str> {
    if !text.chars().any(needs_escape) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        match c {
            '\0' => out.push_str("\\0"),
            '\t' => out.push_str("\\t"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x80 && needs_escape(c) => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c if needs_escape(c) => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    Cow::Owned(out)
}

/// A path as [`escape`]d text (bytes that are not UTF-8 shown as U+FFFD).
pub fn escape_path(path: &Path) -> String {
    escape(&path.to_string_lossy()).into_owned()
}

fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// What is wrong with a URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum UriProblem {
    /// Nothing was given.
    Empty,
    /// A scheme gpuio does not know.
    UnknownScheme(String),
    /// A scheme with characters a scheme cannot have.
    BadScheme(String),
    /// The resource part is missing.
    MissingResource {
        /// What was expected there.
        expected: &'static str,
    },
    /// A resource this engine does not have.
    UnknownResource {
        /// What was found.
        found: String,
        /// What is allowed.
        expected: &'static str,
    },
    /// A path that must be absolute is not.
    NotAbsolute(String),
    /// A parameter value of the wrong form.
    BadParam {
        /// The parameter.
        name: String,
        /// Its value.
        value: String,
        /// What it must be.
        expected: &'static str,
    },
    /// A parameter this URI kind does not take.
    UnknownParam {
        /// The parameter.
        name: String,
        /// The ones it takes.
        allowed: &'static str,
    },
    /// A parameter given twice.
    DuplicateParam(String),
    /// A `key` without `=value`.
    MissingValue(String),
    /// A port that is not 1–65535.
    BadPort(String),
    /// A remote URI without a host or segment.
    MissingHost,
    /// A host or segment name with brackets out of place (IPv6 hosts are written `[addr]:port`).
    BadHost(String),
    /// A `%` not followed by two hex digits.
    BadPercentEncoding,
    /// `gpu` followed by something other than a device number.
    BadGpuShorthand(String),
    /// `gpuio://gpuio/...` nested deeper than [`crate::MAX_URI_NESTING`].
    TooDeep {
        /// The deepest nesting accepted.
        max: usize,
    },
}

impl fmt::Display for UriProblem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Empty => write!(f, "empty URI"),
            Self::BadHost(h) => write!(
                f,
                "host {} has brackets out of place (an IPv6 host is written [addr]:port)",
                escape(&format!("{h:?}"))
            ),
            Self::UnknownScheme(s) => write!(
                f,
                "unknown scheme {s:?} (expected memio, localio, remoteio, file, gpuio, or gpu<N>)"
            ),
            Self::BadScheme(s) => write!(f, "{s:?} is not a valid scheme"),
            Self::MissingResource { expected } => {
                write!(f, "missing resource: expected {expected}")
            }
            Self::UnknownResource { found, expected } => {
                write!(f, "unknown resource {found:?}: expected {expected}")
            }
            Self::NotAbsolute(p) => write!(f, "path {p:?} must be absolute (scheme:///path)"),
            Self::BadParam {
                name,
                value,
                expected,
            } => write!(
                f,
                "parameter {}={}: expected {expected}",
                escape(name),
                escape(&format!("{value:?}"))
            ),
            // An empty list would read "(allowed: )".
            Self::UnknownParam { name, allowed: "" } => {
                write!(
                    f,
                    "unknown parameter {name:?} (this URI takes no parameters)"
                )
            }
            Self::UnknownParam { name, allowed } => {
                write!(f, "unknown parameter {name:?} (allowed: {allowed})")
            }
            Self::DuplicateParam(n) => write!(f, "parameter {n:?} given twice"),
            Self::MissingValue(n) => write!(
                f,
                "parameter {} has no value (expected {}=...)",
                escape(&format!("{n:?}")),
                escape(n)
            ),
            Self::BadPort(p) => write!(f, "port {p:?} is not a number from 1 to 65535"),
            Self::MissingHost => write!(f, "missing host:port or segment name"),
            Self::BadPercentEncoding => write!(f, "'%' must be followed by two hex digits"),
            Self::TooDeep { max } => write!(
                f,
                "gpuio://gpuio/... nested more than {max} deep (gpuio://<engine>/... needs one level)"
            ),
            Self::BadGpuShorthand(s) => {
                write!(
                    f,
                    "{s:?} is not a GPU: expected gpu<N> with N a device number"
                )
            }
        }
    }
}

/// gpuio-api's errors.
///
/// Their messages show paths, URIs and other text given by users through [`escape`], so
/// control characters in a hostile file name cannot drive the terminal that prints them
/// (this covers the messages of the layers below too).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A transfer, allocation or device operation failed.
    // No `#[source]`: a chain printer would show the lower layer's message again, unescaped.
    #[error("{}", escape(&.0.to_string()))]
    Core(CoreError),
    /// RemoteIO failed (network, protocol, authentication, or the agent refused).
    #[error("{}", escape(&.0.to_string()))]
    Remote(gpuio_transport_remoteio::RemoteIoError),
    /// A malformed resource URI.
    #[error(
        "invalid URI {}: {} (at byte {position})",
        escape(&format!("{input:?}")),
        escape(&problem.to_string())
    )]
    Uri {
        /// The URI as given.
        input: String,
        /// Byte offset where the problem starts.
        position: usize,
        /// What is wrong.
        problem: UriProblem,
    },
    /// A configuration file or value that cannot be used.
    #[error("configuration {}: {}", escape(.source_name), escape(.message))]
    Config {
        /// The file (or `<built-in>`, or `the environment`).
        source_name: String,
        /// What is wrong.
        message: String,
    },
    /// An environment override that does not parse.
    #[error(
        "environment variable {var}={}: expected {expected}",
        escape(&format!("{value:?}"))
    )]
    ConfigEnv {
        /// The variable.
        var: String,
        /// Its value.
        value: String,
        /// What it must be.
        expected: String,
    },
    /// A request that cannot be carried out as asked.
    #[error("{}", escape(.0))]
    Invalid(String),
    /// A safetensors checkpoint whose header cannot be used: nothing is read from it.
    #[error("safetensors file {path}: {}", escape(.problem))]
    Safetensors {
        /// The file (escaped).
        path: String,
        /// What is wrong.
        problem: String,
    },
    /// A named resource that does not exist (e.g. a segment no agent serves).
    #[error("not found: {}", escape(.0))]
    NotFound(String),
    /// A path gpuio has but this build or machine does not.
    #[error("{} is not supported: {}", escape(.what), escape(.reason))]
    Unsupported {
        /// What was asked.
        what: String,
        /// Why not.
        reason: String,
    },
    /// Verification found the copy differs from its source.
    #[error("verification failed: source crc32c {src:08x}, destination crc32c {dst:08x}")]
    VerifyMismatch {
        /// Source checksum.
        src: u32,
        /// Destination checksum.
        dst: u32,
    },
}

impl Error {
    /// This error's code (docs/REFERENCE.md#error-codes).
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::Core(e) => e.code(),
            Self::Remote(e) => e.code(),
            Self::Uri { .. }
            | Self::Config { .. }
            | Self::ConfigEnv { .. }
            | Self::Safetensors { .. }
            | Self::Invalid(_) => ErrorCode::InvalidArg,
            Self::Unsupported { .. } => ErrorCode::Unsupported,
            Self::NotFound(_) => ErrorCode::NotFound,
            Self::VerifyMismatch { .. } => ErrorCode::Io,
        }
    }
}

impl From<CoreError> for Error {
    fn from(e: CoreError) -> Self {
        Self::Core(e)
    }
}

impl From<gpuio_transport_remoteio::RemoteIoError> for Error {
    fn from(e: gpuio_transport_remoteio::RemoteIoError) -> Self {
        Self::Remote(e)
    }
}

impl From<HalError> for Error {
    fn from(e: HalError) -> Self {
        Self::Core(e.into())
    }
}

impl From<MemIoError> for Error {
    fn from(e: MemIoError) -> Self {
        Self::Core(e.into())
    }
}

impl From<LocalIoError> for Error {
    fn from(e: LocalIoError) -> Self {
        Self::Core(e.into())
    }
}

/// gpuio-api's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    #[test]
    fn escape_shows_control_characters_and_keeps_the_rest() {
        assert!(matches!(escape("plain/path ünï"), Cow::Borrowed(_)));
        assert_eq!(
            escape("a\u{1b}[31mb\0c\nd\re\tf\u{7f}g\u{9b}h\u{202e}i"),
            "a\\x1b[31mb\\0c\\nd\\re\\tf\\x7fg\\u{9b}h\\u{202e}i"
        );
        let once = escape("x\u{1b}\\y").into_owned();
        assert_eq!(escape(&once), once, "escaping twice changes nothing");
        assert_eq!(
            escape_path(Path::new("/tmp/\u{1b}]0;t\u{7}")),
            "/tmp/\\x1b]0;t\\x07"
        );
    }

    #[test]
    fn unknown_parameters_name_the_allowed_ones_or_say_there_are_none() {
        let e = crate::Uri::parse("memio://gpu/0?speed=1")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("\"speed\"")
                && e.contains("takes no parameters")
                && !e.contains("allowed: )"),
            "{e}"
        );
        let e = crate::Uri::parse("memio://cpu/dram?speed=1")
            .unwrap_err()
            .to_string();
        assert!(e.contains("(allowed: numa)"), "{e}");
    }

    #[test]
    fn error_messages_never_carry_raw_control_characters() {
        let hostile = "/tmp/\u{1b}[2J\u{1b}]0;owned\u{7}\nfake line\0";
        let errors: Vec<Error> = vec![
            LocalIoError::Open {
                path: PathBuf::from(hostile),
                source: std::io::ErrorKind::NotFound.into(),
            }
            .into(),
            Error::Invalid(format!("{hostile} is bad")),
            Error::NotFound(hostile.into()),
            Error::Unsupported {
                what: hostile.into(),
                reason: hostile.into(),
            },
            Error::Config {
                source_name: hostile.into(),
                message: hostile.into(),
            },
            Error::ConfigEnv {
                var: "GPUIO_X".into(),
                value: hostile.into(),
                expected: "x".into(),
            },
            crate::Uri::parse(&format!("memio://cpu/dram?{hostile}=1")).unwrap_err(),
            crate::Uri::parse("memio://cpu/dram?n\u{1b}").unwrap_err(),
        ];
        for e in errors {
            let shown = e.to_string();
            assert!(
                !shown.chars().any(|c| c.is_control()),
                "raw control character in {shown:?}"
            );
            assert!(
                shown.contains("\\x1b") || shown.contains("\\u{1b}"),
                "{shown}"
            );
        }
    }
}
