//! The request ring's one shared layout: the `#[repr(C)]` structs that GPU threads and host
//! threads both read and write ([`RingHeader`], [`RingSlot`]), the descriptor kernels receive by
//! value ([`RingDevice`]), and the constants of the protocol, all mirrored by
//! `kernels/gpuio_ring.cuh`. It lives apart so that the one thing both sides must agree on is in
//! one place: const asserts below pin every offset and size here, `static_assert`s pin them in
//! the header, [`layout()`] lists them for the `gpuio_ring_layout` kernel's report (compared on
//! the GPU), and the tests compare the header's `#define`s and the layout kernel's list.

use super::result_of;
use gpuio_hal::error::ErrorCode;
use std::mem::{align_of, offset_of, size_of};
use std::sync::atomic::{AtomicU32, AtomicU64};

// ---------------------------------------------------------------------------------------------
// Constants shared with kernels/gpuio_ring.cuh (the `GPUIO_*` name of each is in `layout()`).

/// `GPUIO_RING_MAGIC`: the header's first word, the bytes "GPIO".
pub const MAGIC: u32 = u32::from_le_bytes(*b"GPIO");
/// `GPUIO_RING_VERSION`: the layout version; bumped on any change of the shared structs.
pub const VERSION: u32 = 2;

/// `GPUIO_RING_OPEN`: requests are accepted and served.
pub const RING_OPEN: u32 = 0;
/// `GPUIO_RING_STOPPING`: no new requests are accepted; those being served finish.
pub const RING_STOPPING: u32 = 1;
/// `GPUIO_RING_CLOSED`: the host writes the ring no more.
pub const RING_CLOSED: u32 = 2;

/// `GPUIO_SLOT_FREE`: the state a slot starts in. A collected slot keeps its last `DONE`
/// state until the next lap posts: whose turn a slot is, and when it is free for it, only
/// the producers track (in their claim memory, see [`RingDevice::claim`]).
pub const SLOT_FREE: u32 = 0;
/// `GPUIO_SLOT_POSTED`: a request is in the slot, waiting for (or with) a consumer. Its status
/// word carries the ticket it was posted under where a result goes ([`posted_word`]).
pub const SLOT_POSTED: u32 = 1;
/// `GPUIO_SLOT_DONE`: the status word holds the outcome; the bytes (if any) are at their
/// destination.
pub const SLOT_DONE: u32 = 2;
/// `GPUIO_SLOT_DONE_INLINE`: a staged READ of at most [`INLINE_BYTES`] bytes is done and its
/// bytes are in the slot's `inline_bytes` word (in memory order), beside the status: the
/// producer reads them with the completion.
pub const SLOT_DONE_INLINE: u32 = 3;
/// `GPUIO_SLOT_DONE_BOUNCE`: a staged READ is done and its bytes are in the slot's bounce
/// buffer; the producer copies them to the destination.
pub const SLOT_DONE_BOUNCE: u32 = 4;
/// Bytes a completion can carry inline (the `inline_bytes` word).
pub const INLINE_BYTES: usize = 8;
/// `GPUIO_RING_INLINE_MARKER`: a producer stores `INLINE_MARKER * (ticket + 1)` in its slot's
/// `inline_bytes` when it posts ([`inline_marker`]). A GPU thread reads that word in the same
/// load as the status, unordered after it; a value other than its own marker can then only
/// be the consumer's bytes of this lap (a marker-valued one is read again after the acquire).
pub const INLINE_MARKER: u64 = 0x9E37_79B9_7F4A_7C15;

/// The marker a producer of `ticket` stores in the slot's `inline_bytes` when it posts.
pub const fn inline_marker(ticket: u64) -> u64 {
    INLINE_MARKER.wrapping_mul(ticket.wrapping_add(1))
}
/// `GPUIO_SLOT_STATE_BITS`: a status word is `state | result << STATE_BITS`, so that one
/// 8-byte store publishes a completion and one 16-byte load (status and inline bytes) reads
/// all of it: a PCIe round trip for the GPU, not two.
pub const STATE_BITS: u32 = 8;

/// The status word of `state` with `result` (bytes moved or a negative code; results beyond
/// the word's 56 bits, which no transfer reaches, saturate).
pub const fn status_word(state: u32, result: i64) -> u64 {
    const MAX: i64 = i64::MAX >> STATE_BITS;
    const MIN: i64 = i64::MIN >> STATE_BITS;
    let r = if result > MAX {
        MAX
    } else if result < MIN {
        MIN
    } else {
        result
    };
    ((r << STATE_BITS) as u64) | (state & 0xff) as u64
}

/// The status word of a request posted under `ticket`: `POSTED` with the ticket's low 56 bits
/// above the state. One acquire load tells a consumer that its own ticket's request is there:
/// a `POSTED` of an earlier lap (still waiting for its consumer) carries that lap's ticket.
pub const fn posted_word(ticket: u64) -> u64 {
    (ticket << STATE_BITS) | SLOT_POSTED as u64
}

/// The state of a status word.
pub const fn status_state(word: u64) -> u32 {
    (word & 0xff) as u32
}

/// The result of a status word (arithmetic shift: negative codes stay negative).
pub const fn status_result(word: u64) -> i64 {
    (word as i64) >> STATE_BITS
}

/// `GPUIO_RING_OP_READ`: resource → device memory.
pub const OP_READ: u32 = 1;
/// `GPUIO_RING_OP_WRITE`: device memory → resource.
pub const OP_WRITE: u32 = 2;

/// `GPUIO_RING_FLAG_DURABLE`: a WRITE to a file reaches stable storage before it completes.
pub const FLAG_DURABLE: u32 = 1;
/// Request flag: a READ's bytes may be delivered into the slot's bounce buffer in pinned host
/// memory instead of device memory (the producer then copies them to its destination
/// itself); a WRITE's bytes are in the bounce buffer already (the producer put them there
/// before posting). Either way the host side needs no DMA and no driver call per request.
pub const FLAG_STAGE: u32 = 2;
/// Every flag bit this version knows; a request with another bit set is refused.
pub const FLAGS_KNOWN: u32 = FLAG_DURABLE | FLAG_STAGE;

pub use gpuio_hal::error::{RESULT_SHUT_DOWN, RESULT_UNREGISTERED};

// ---------------------------------------------------------------------------------------------
// The shared layout.

/// The ring's header, at the start of the ring memory (`struct gpuio_ring_header`): one cache
/// line that the host writes rarely (only `state`, at shutdown) and the GPU polls.
#[repr(C, align(64))]
pub struct RingHeader {
    pub(super) magic: AtomicU32,
    pub(super) version: AtomicU32,
    pub(super) slots: AtomicU32,
    pub(super) state: AtomicU32,
    _reserved: [AtomicU32; 12],
}

/// One request slot (`struct gpuio_ring_slot`), a cache line of its own. The producer writes
/// the request fields, `turn` and the status `POSTED` (with its ticket); the consumer writes
/// the status `DONE*`
/// (with the result) and an inline completion's bytes. The status and the inline bytes come
/// first, in one aligned 16 bytes, so that a GPU thread polls a completion with one load.
#[repr(C, align(64))]
pub struct RingSlot {
    /// `state | result << STATE_BITS` ([`status_word`]).
    pub(super) status: AtomicU64,
    /// The bytes of a `DONE_INLINE` completion.
    pub(super) inline_bytes: AtomicU64,
    /// The ticket last posted in the slot (diagnostics: the status word carries it too).
    pub(super) turn: AtomicU64,
    pub(super) op: AtomicU32,
    pub(super) resource: AtomicU32,
    pub(super) flags: AtomicU32,
    _reserved: AtomicU32,
    pub(super) offset: AtomicU64,
    pub(super) len: AtomicU64,
    pub(super) dev_addr: AtomicU64,
}

/// What a kernel receives by value to reach a ring (`struct gpuio_ring`): device addresses
/// of the header, the slots and the producers' claim memory, and the slot mask.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingDevice {
    /// Device address of the [`RingHeader`].
    pub header: u64,
    /// Device address of slot 0.
    pub slots: u64,
    /// Device address of the producers' claim memory, `1 + nslots` `u64`s in device memory:
    /// the ticket counter the GPU's producers `atomicAdd` on (starts at zero), then slot `i`'s
    /// free turn (starts at `i`): the ticket that may post in it next. Only producers read
    /// and write these (the GPU frees every slot), so a post checks the GPU's own memory, not
    /// the slot across PCIe.
    pub claim: u64,
    /// `nslots - 1`.
    pub mask: u32,
    /// Number of slots (a power of two).
    pub nslots: u32,
    /// Device address of slot 0's bounce buffer (slot `i`'s is `i * bounce_bytes` on), or 0
    /// for a ring without bounce buffers.
    pub bounce: u64,
    /// Bytes of each slot's bounce buffer (0: none).
    pub bounce_bytes: u64,
}

/// Bytes of the header.
pub const HEADER_BYTES: usize = 64;
/// Bytes of one slot.
pub const SLOT_BYTES: usize = 64;

const _: () = {
    assert!(size_of::<AtomicU64>() == 8 && align_of::<AtomicU64>() == 8);
    assert!(size_of::<AtomicU32>() == 4 && align_of::<AtomicU32>() == 4);

    assert!(size_of::<RingHeader>() == HEADER_BYTES);
    assert!(align_of::<RingHeader>() == 64);
    assert!(offset_of!(RingHeader, magic) == 0);
    assert!(offset_of!(RingHeader, version) == 4);
    assert!(offset_of!(RingHeader, slots) == 8);
    assert!(offset_of!(RingHeader, state) == 12);
    assert!(offset_of!(RingHeader, _reserved) == 16);

    assert!(size_of::<RingSlot>() == SLOT_BYTES);
    assert!(align_of::<RingSlot>() == 64);
    assert!(offset_of!(RingSlot, status) == 0);
    assert!(offset_of!(RingSlot, inline_bytes) == 8);
    assert!(offset_of!(RingSlot, turn) == 16);
    assert!(offset_of!(RingSlot, op) == 24);
    assert!(offset_of!(RingSlot, resource) == 28);
    assert!(offset_of!(RingSlot, flags) == 32);
    assert!(offset_of!(RingSlot, _reserved) == 36);
    assert!(offset_of!(RingSlot, offset) == 40);
    assert!(offset_of!(RingSlot, len) == 48);
    assert!(offset_of!(RingSlot, dev_addr) == 56);

    assert!(size_of::<RingDevice>() == 48);
    assert!(align_of::<RingDevice>() == 8);
    assert!(offset_of!(RingDevice, header) == 0);
    assert!(offset_of!(RingDevice, slots) == 8);
    assert!(offset_of!(RingDevice, claim) == 16);
    assert!(offset_of!(RingDevice, mask) == 24);
    assert!(offset_of!(RingDevice, nslots) == 28);
    assert!(offset_of!(RingDevice, bounce) == 32);
    assert!(offset_of!(RingDevice, bounce_bytes) == 40);
};

/// Where one field of a shared struct is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldLayout {
    /// `struct.field` with the C names (a whole struct is listed by its name, at offset 0).
    pub name: &'static str,
    /// Byte offset in its struct.
    pub offset: u64,
    /// Size in bytes.
    pub size: u64,
}

/// The shared layout and constants, in the order `kernels/ring_layout.cu` writes them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RingLayout {
    /// Every struct and field.
    pub fields: Vec<FieldLayout>,
    /// Every shared constant, by its C name.
    pub constants: Vec<(&'static str, i64)>,
}

impl RingLayout {
    /// What the `gpuio_ring_layout` kernel writes into its output array: `offset, size` of
    /// each field, then each constant's value (negative ones in two's complement).
    pub fn words(&self) -> Vec<u64> {
        let mut out = Vec::with_capacity(self.fields.len() * 2 + self.constants.len());
        for f in &self.fields {
            out.push(f.offset);
            out.push(f.size);
        }
        out.extend(self.constants.iter().map(|&(_, v)| v as u64));
        out
    }
}

fn field_size<S, F>(_: fn(&S) -> &F) -> usize {
    size_of::<F>()
}

macro_rules! struct_entry {
    ($ty:ty, $cname:literal) => {
        FieldLayout {
            name: $cname,
            offset: 0,
            size: size_of::<$ty>() as u64,
        }
    };
}

macro_rules! field_entry {
    ($ty:ty, $cname:literal, $field:ident) => {
        FieldLayout {
            name: concat!($cname, ".", stringify!($field)),
            offset: offset_of!($ty, $field) as u64,
            size: field_size::<$ty, _>(|s| &s.$field) as u64,
        }
    };
}

/// The shared layout: what a device test compares against the `offsetof`/`sizeof` values the
/// `gpuio_ring_layout` kernel of `kernels/ring_layout.cu` reports.
pub fn layout() -> RingLayout {
    let fields = vec![
        struct_entry!(RingHeader, "gpuio_ring_header"),
        field_entry!(RingHeader, "gpuio_ring_header", magic),
        field_entry!(RingHeader, "gpuio_ring_header", version),
        field_entry!(RingHeader, "gpuio_ring_header", slots),
        field_entry!(RingHeader, "gpuio_ring_header", state),
        struct_entry!(RingSlot, "gpuio_ring_slot"),
        field_entry!(RingSlot, "gpuio_ring_slot", status),
        field_entry!(RingSlot, "gpuio_ring_slot", inline_bytes),
        field_entry!(RingSlot, "gpuio_ring_slot", turn),
        field_entry!(RingSlot, "gpuio_ring_slot", op),
        field_entry!(RingSlot, "gpuio_ring_slot", resource),
        field_entry!(RingSlot, "gpuio_ring_slot", flags),
        field_entry!(RingSlot, "gpuio_ring_slot", offset),
        field_entry!(RingSlot, "gpuio_ring_slot", len),
        field_entry!(RingSlot, "gpuio_ring_slot", dev_addr),
        struct_entry!(RingDevice, "gpuio_ring"),
        field_entry!(RingDevice, "gpuio_ring", header),
        field_entry!(RingDevice, "gpuio_ring", slots),
        field_entry!(RingDevice, "gpuio_ring", claim),
        field_entry!(RingDevice, "gpuio_ring", mask),
        field_entry!(RingDevice, "gpuio_ring", nslots),
        field_entry!(RingDevice, "gpuio_ring", bounce),
        field_entry!(RingDevice, "gpuio_ring", bounce_bytes),
    ];
    let mut constants: Vec<(&'static str, i64)> = vec![
        ("GPUIO_RING_MAGIC", MAGIC.into()),
        ("GPUIO_RING_VERSION", VERSION.into()),
        ("GPUIO_RING_OPEN", RING_OPEN.into()),
        ("GPUIO_RING_STOPPING", RING_STOPPING.into()),
        ("GPUIO_RING_CLOSED", RING_CLOSED.into()),
        ("GPUIO_SLOT_FREE", SLOT_FREE.into()),
        ("GPUIO_SLOT_POSTED", SLOT_POSTED.into()),
        ("GPUIO_SLOT_DONE", SLOT_DONE.into()),
        ("GPUIO_SLOT_DONE_INLINE", SLOT_DONE_INLINE.into()),
        ("GPUIO_SLOT_DONE_BOUNCE", SLOT_DONE_BOUNCE.into()),
        ("GPUIO_SLOT_STATE_BITS", STATE_BITS.into()),
        ("GPUIO_RING_OP_READ", OP_READ.into()),
        ("GPUIO_RING_OP_WRITE", OP_WRITE.into()),
        ("GPUIO_RING_FLAG_DURABLE", FLAG_DURABLE.into()),
        ("GPUIO_RING_FLAG_STAGE", FLAG_STAGE.into()),
    ];
    for code in ErrorCode::ALL {
        constants.push((code.name(), result_of(code)));
    }
    constants.push(("GPUIO_ERROR_RING_UNREGISTERED", RESULT_UNREGISTERED));
    constants.push(("GPUIO_ERROR_RING_SHUTDOWN", RESULT_SHUT_DOWN));
    RingLayout { fields, constants }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn layout_matches_the_protocol_document() {
        let l = layout();
        let find = |n: &str| *l.fields.iter().find(|f| f.name == n).unwrap();
        assert_eq!(find("gpuio_ring_header").size, 64);
        assert_eq!(find("gpuio_ring_header.state").offset, 12);
        assert_eq!(find("gpuio_ring_slot").size, 64);
        for (name, offset, size) in [
            ("status", 0, 8),
            ("inline_bytes", 8, 8),
            ("turn", 16, 8),
            ("op", 24, 4),
            ("resource", 28, 4),
            ("flags", 32, 4),
            ("offset", 40, 8),
            ("len", 48, 8),
            ("dev_addr", 56, 8),
        ] {
            let f = find(&format!("gpuio_ring_slot.{name}"));
            assert_eq!((f.offset, f.size), (offset, size), "{name}");
        }
        assert_eq!(find("gpuio_ring").size, 48);
        assert_eq!(find("gpuio_ring.nslots").offset, 28);
        assert_eq!(find("gpuio_ring.bounce").offset, 32);
        assert_eq!(find("gpuio_ring.bounce_bytes").offset, 40);
        assert_eq!(l.words().len(), l.fields.len() * 2 + l.constants.len());
        assert_eq!(MAGIC, 0x4F49_5047);
        let names: Vec<_> = l.constants.iter().map(|c| c.0).collect();
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "constant names are unique");
    }

    #[test]
    fn status_words_carry_state_and_result() {
        for state in [
            SLOT_FREE,
            SLOT_POSTED,
            SLOT_DONE,
            SLOT_DONE_INLINE,
            SLOT_DONE_BOUNCE,
        ] {
            for result in [0, 1, 8, 4096, 1 << 40, -1, -64, -65] {
                let w = status_word(state, result);
                assert_eq!((status_state(w), status_result(w)), (state, result));
            }
        }
        // A posted word carries its ticket (the low 56 bits) and reads as POSTED.
        for t in [0u64, 1, 4095, 1 << 40, u64::MAX] {
            let w = posted_word(t);
            assert_eq!(status_state(w), SLOT_POSTED);
            assert_eq!(w >> STATE_BITS, t & (u64::MAX >> STATE_BITS));
        }
        assert_ne!(posted_word(5), posted_word(5 + 4096));
        // Beyond 56 bits a result saturates instead of wrapping into another state or sign.
        let big = status_word(SLOT_DONE, i64::MAX);
        assert_eq!(status_state(big), SLOT_DONE);
        assert_eq!(status_result(big), i64::MAX >> STATE_BITS);
        assert_eq!(
            status_result(status_word(SLOT_DONE, i64::MIN)),
            i64::MIN >> STATE_BITS
        );
    }

    /// `#define NAME VALUE` lines of the CUDA header, values parsed as C integer literals.
    fn header_defines(text: &str) -> BTreeMap<String, i64> {
        let mut out = BTreeMap::new();
        for line in text.lines() {
            let mut words = line.split_whitespace();
            if words.next() != Some("#define") {
                continue;
            }
            let (Some(name), Some(value)) = (words.next(), words.next()) else {
                continue;
            };
            let v = value
                .trim_start_matches('(')
                .trim_end_matches(')')
                .trim_end_matches(['u', 'U', 'l', 'L']);
            let (neg, digits) = match v.strip_prefix('-') {
                Some(d) => (true, d),
                None => (false, v),
            };
            let parsed = match digits.strip_prefix("0x") {
                Some(hex) => i64::from_str_radix(hex, 16),
                None => digits.parse::<i64>(),
            };
            if let Ok(n) = parsed {
                out.insert(name.to_string(), if neg { -n } else { n });
            }
        }
        out
    }

    #[test]
    fn cuda_header_constants_match() {
        let defines = header_defines(include_str!("../../../kernels/gpuio_ring.cuh"));
        for (name, value) in layout().constants {
            assert_eq!(defines.get(name), Some(&value), "{name} in gpuio_ring.cuh");
        }
    }

    #[test]
    fn cuda_header_inline_marker_matches() {
        let text = include_str!("../../../kernels/gpuio_ring.cuh");
        let line = format!("#define GPUIO_RING_INLINE_MARKER {INLINE_MARKER:#X}ull");
        assert!(text.contains(&line.replace("0X", "0x")), "{line}");
    }

    #[test]
    fn layout_kernel_lists_the_same_fields_in_the_same_order() {
        let src = include_str!("../kernels/ring_layout.cu");
        let mut listed = Vec::new();
        for line in src.lines().map(str::trim) {
            let args = |prefix: &str| {
                line.strip_prefix(prefix)
                    .and_then(|r| r.split_once(')'))
                    .map(|(a, _)| {
                        a.split(',')
                            .map(|s| s.trim().to_string())
                            .collect::<Vec<_>>()
                    })
            };
            if let Some(a) = args("GPUIO_LAYOUT_STRUCT(") {
                listed.push(a[0].clone());
            } else if let Some(a) = args("GPUIO_LAYOUT_FIELD(") {
                listed.push(format!("{}.{}", a[0], a[1]));
            } else if let Some(a) = args("GPUIO_LAYOUT_CONST(") {
                listed.push(a[0].clone());
            }
        }
        let l = layout();
        let expected: Vec<String> = l
            .fields
            .iter()
            .map(|f| f.name.to_string())
            .chain(l.constants.iter().map(|c| c.0.to_string()))
            .collect();
        assert_eq!(listed, expected);
    }
}
