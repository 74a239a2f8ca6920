//! Compression: lossy KV quantization (FP16, FP8, INT8, INT4; on the host or the GPU) and
//! lossless frames (LZ4, ZSTD, crc32c-checked), and transfers that carry frames to files
//! and other nodes' exports.

use super::{f32s, settle, shared_gpus, to_py};
use crate::buffers::{DeviceBuffer, Target};
use crate::error::{DetachIn, invalid};
use crate::session::Session;
use gpuio_ai::compress::{self as c, CompressedReport, KvFormat};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

/// A format by name (`f16`, `fp8`, `int8`, `int4`) with its block (values per scale).
fn format(name: &str, block: usize) -> PyResult<KvFormat> {
    match name {
        "f16" => Ok(KvFormat::F16),
        "fp8" => Ok(KvFormat::Fp8 { block }),
        "int8" => Ok(KvFormat::Int8 { block }),
        "int4" => Ok(KvFormat::Int4 { group: block }),
        _ => Err(invalid(format!(
            "KV format {name:?}: f16, fp8, int8 or int4"
        ))),
    }
}

fn format_name(f: KvFormat) -> (&'static str, usize) {
    match f {
        KvFormat::F16 => ("f16", 0),
        KvFormat::Fp8 { block } => ("fp8", block),
        KvFormat::Int8 { block } => ("int8", block),
        KvFormat::Int4 { group } => ("int4", group),
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn compressed_report<'py>(py: Python<'py>, r: &CompressedReport) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("raw_bytes", r.raw_bytes)?;
    d.set_item("stored_bytes", r.stored_bytes)?;
    d.set_item("frames", r.frames)?;
    Ok(d)
}

/// Quantized values in host memory: packed `data` and one f32 scale per block.
#[pyclass(module = "gpuio.ai", frozen)]
pub struct QuantizedKv {
    q: c::QuantizedKv,
}

#[pymethods]
impl QuantizedKv {
    /// The format's name and its block (0 for f16).
    #[getter]
    fn format(&self) -> (&'static str, usize) {
        format_name(self.q.format())
    }

    /// Values quantized.
    fn __len__(&self) -> usize {
        self.q.len()
    }

    /// The packed values.
    #[getter]
    fn data<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.q.data())
    }

    /// The scales, as little-endian f32 bytes.
    #[getter]
    fn scales<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &f32_bytes(self.q.scales()))
    }

    /// Bytes of data and scales.
    #[getter]
    fn stored_bytes(&self) -> usize {
        self.q.stored_bytes()
    }

    /// The values back, as little-endian f32 bytes.
    fn dequantize<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let v = py.detach_kept(|| f32_bytes(&self.q.dequantize()));
        PyBytes::new(py, &v)
    }
}

/// Quantized values in device memory.
#[pyclass(module = "gpuio.ai", frozen)]
pub struct DeviceQuantizedKv {
    q: c::DeviceQuantizedKv,
}

#[pymethods]
impl DeviceQuantizedKv {
    /// The format's name and its block (0 for f16).
    #[getter]
    fn format(&self) -> (&'static str, usize) {
        format_name(self.q.format())
    }

    /// Values quantized.
    fn __len__(&self) -> usize {
        self.q.len()
    }

    /// Bytes of data and scales in device memory.
    #[getter]
    fn stored_bytes(&self) -> usize {
        self.q.stored_bytes()
    }

    /// Writes the values back as f32s into `dst` (device memory) from `dst_offset`.
    #[pyo3(signature = (dst, dst_offset=0))]
    fn dequantize_into(
        &self,
        py: Python<'_>,
        dst: &DeviceBuffer,
        dst_offset: usize,
    ) -> PyResult<()> {
        let wait = shared_gpus(&[dst]);
        py.detach_kept(|| {
            settle(&wait)?;
            self.q.dequantize_into(&dst.buf, dst_offset)
        })
        .map_err(to_py)
    }

    /// A host copy (equal, bit for bit, to quantizing the same values on the host).
    fn to_host(&self, py: Python<'_>) -> PyResult<QuantizedKv> {
        let q = py.detach_kept(|| self.q.to_host()).map_err(to_py)?;
        Ok(QuantizedKv { q })
    }
}

/// Quantizes `values` (little-endian f32s) on the host.
#[pyfunction]
#[pyo3(signature = (values, format, block=32))]
fn quantize(py: Python<'_>, values: &[u8], format: &str, block: usize) -> PyResult<QuantizedKv> {
    let f = self::format(format, block)?;
    let values = f32s(values, "values")?;
    let q = py.detach_kept(|| f.quantize(&values)).map_err(to_py)?;
    Ok(QuantizedKv { q })
}

/// Quantizes `len` f32s of `src` (device memory, from the 4-aligned `src_offset`) on its GPU.
#[pyfunction]
#[pyo3(signature = (src, len, format, block=32, src_offset=0))]
fn quantize_device(
    py: Python<'_>,
    src: &DeviceBuffer,
    len: usize,
    format: &str,
    block: usize,
    src_offset: usize,
) -> PyResult<DeviceQuantizedKv> {
    let f = self::format(format, block)?;
    let wait = shared_gpus(&[src]);
    let q = py
        .detach_kept(|| {
            settle(&wait)?;
            f.quantize_device(&src.buf, src_offset, len)
        })
        .map_err(to_py)?;
    Ok(DeviceQuantizedKv { q })
}

/// `data` as one frame of `codec` (`lz4`, `zstd` at `level`), its crc32c in the header.
#[pyfunction]
#[pyo3(signature = (data, codec="lz4", level=3))]
fn compress<'py>(
    py: Python<'py>,
    data: &[u8],
    codec: &str,
    level: i32,
) -> PyResult<Bound<'py, PyBytes>> {
    let codec = super::kv::codec(codec, level)?;
    let frame = py.detach_kept(|| codec.compress(data)).map_err(to_py)?;
    Ok(PyBytes::new(py, &frame))
}

/// The bytes of one frame, checked (at most `max_len` of them; a damaged frame raises).
#[pyfunction]
fn decompress<'py>(py: Python<'py>, frame: &[u8], max_len: usize) -> PyResult<Bound<'py, PyBytes>> {
    let raw = py
        .detach_kept(|| c::decompress(frame, max_len))
        .map_err(to_py)?;
    Ok(PyBytes::new(py, &raw))
}

/// What a frame's header says: codec, raw_len, crc32c, frame_len.
#[pyfunction]
fn frame_info<'py>(py: Python<'py>, frame: &[u8]) -> PyResult<Bound<'py, PyDict>> {
    let i = c::frame_info(frame).map_err(to_py)?;
    let d = PyDict::new(py);
    d.set_item(
        "codec",
        match i.codec {
            c::Codec::Lz4 => "lz4",
            c::Codec::Zstd { .. } => "zstd",
        },
    )?;
    d.set_item("raw_len", i.raw_len)?;
    d.set_item("crc32c", i.crc32c)?;
    d.set_item("frame_len", i.frame_len)?;
    Ok(d)
}

/// The endpoint of a gpuio buffer or resource at `offset` (host memory Python lends is not
/// one: the frames are written piece by piece).
fn endpoint(end: &Bound<'_, PyAny>, offset: u64) -> PyResult<gpuio_api::Endpoint> {
    let t = Target::of(end)?;
    t.endpoint(offset)?.ok_or_else(|| {
        invalid("a compressed transfer's ends are gpuio buffers or opened resources")
    })
}

/// Compresses `size` bytes of `src` (host or GPU memory) at `src_offset` with `codec` and
/// writes the frames at `dst` (a file or another node's export) from `dst_offset`.
#[pyfunction]
#[pyo3(signature = (session, src, dst, size, codec="lz4", level=3, src_offset=0, dst_offset=0))]
#[allow(clippy::too_many_arguments)]
fn transfer_compressed<'py>(
    py: Python<'py>,
    session: &Session,
    src: &Bound<'py, PyAny>,
    dst: &Bound<'py, PyAny>,
    size: usize,
    codec: &str,
    level: i32,
    src_offset: u64,
    dst_offset: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let codec = super::kv::codec(codec, level)?;
    let (from, to) = (endpoint(src, src_offset)?, endpoint(dst, dst_offset)?);
    let s = session.session();
    let r = py
        .detach_in(s, || c::transfer_compressed(s, &from, &to, size, codec))?
        .map_err(to_py)?;
    compressed_report(py, &r)
}

/// Reads frames written by `transfer_compressed` at `src` until `size` raw bytes have come
/// back into `dst` (host or GPU memory); a damaged frame raises.
#[pyfunction]
#[pyo3(signature = (session, src, dst, size, src_offset=0, dst_offset=0))]
fn read_compressed<'py>(
    py: Python<'py>,
    session: &Session,
    src: &Bound<'py, PyAny>,
    dst: &Bound<'py, PyAny>,
    size: usize,
    src_offset: u64,
    dst_offset: u64,
) -> PyResult<Bound<'py, PyDict>> {
    let (from, to) = (endpoint(src, src_offset)?, endpoint(dst, dst_offset)?);
    let s = session.session();
    let r = py
        .detach_in(s, || c::read_compressed(s, &from, &to, size))?
        .map_err(to_py)?;
    compressed_report(py, &r)
}

pub(super) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<QuantizedKv>()?;
    m.add_class::<DeviceQuantizedKv>()?;
    m.add_function(wrap_pyfunction!(quantize, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_device, m)?)?;
    m.add_function(wrap_pyfunction!(compress, m)?)?;
    m.add_function(wrap_pyfunction!(decompress, m)?)?;
    m.add_function(wrap_pyfunction!(frame_info, m)?)?;
    m.add_function(wrap_pyfunction!(transfer_compressed, m)?)?;
    m.add_function(wrap_pyfunction!(read_compressed, m)?)?;
    Ok(())
}
