#![doc = include_str!("../README.md")]
// `unsafe` lives in one module, `lent`: Python's buffer memory as a slice.
#![deny(unsafe_code)]

//! The extension module `gpuio._gpuio`: the Rust half of the binding. Python objects are
//! resolved into gpuio buffers in the package's Python half (`python/gpuio/`), which is also
//! where the public names live; this half only maps gpuio-api calls, releasing the GIL for
//! every one that moves data.

mod ai;
mod buffers;
mod checked;
mod error;
mod lent;
mod ondemand;
mod session;

use pyo3::prelude::*;

// The binding's Rust allocations (plans, request lists, reports) are made and freed on many
// threads at once; with glibc's malloc a B1 step ran 2-10 us slower on the H200's host than
// with mimalloc. Python keeps its own allocator for its objects.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Devices and capabilities as JSON (what `gpuio info` prints), probed once per call.
#[pyfunction]
fn info_json(py: Python<'_>) -> PyResult<String> {
    let probe = py
        .detach(|| gpuio_api::Session::new(gpuio_api::Config::default()))
        .map_err(error::to_py)?
        .probe()
        .clone();
    let devices: Vec<_> = probe.gpus.iter().map(|g| g.info().clone()).collect();
    let doc = serde_json::json!({
        "version": env!("CARGO_PKG_VERSION"),
        "cuda": probe.cuda,
        "devices": devices,
    });
    Ok(doc.to_string())
}

/// The crc32c (Castagnoli) of a buffer's bytes (bytes, or a byte memoryview the Python half
/// made), with the GIL released: what gpuio's frames and the LMCache connector check chunks by.
#[pyfunction(name = "crc32c")]
fn checksum(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<u32> {
    let lent = lent::Lent::of(data)?;
    Ok(py.detach(|| ::crc32c::crc32c(lent.bytes())))
}

/// The device API's headers as one text, for kernels compiled at run time (CuPy's
/// `RawModule`, NVRTC): put it in front of a source that uses `gpuio_array<T>`.
#[pyfunction]
fn device_header() -> &'static str {
    gpuio_api::DEVICE_HEADER
}

/// A tensor of a safetensors header: name, dtype (safetensors' spelling), shape, its bytes'
/// begin and end relative to the data start, and its strides in elements (row-major: what a
/// view of it takes, made here so that 4096 views do not each compute them in Python).
type TensorRow = (String, String, Vec<usize>, u64, u64, Vec<usize>);

/// Row-major strides, in elements, of a tensor of `shape`, as torch makes them (a dimension
/// of 0 steps as one of 1; saturating: the header's checks bound the product by the file).
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut out = vec![0; shape.len()];
    let mut step = 1usize;
    for (s, &n) in out.iter_mut().zip(shape).rev() {
        *s = step;
        step = step.saturating_mul(n.max(1));
    }
    out
}

/// A safetensors header as Python gets it: the data start, the `__metadata__` map (or None)
/// and the tensors in file order.
type HeaderRows = (
    u64,
    Option<std::collections::HashMap<String, String>>,
    Vec<TensorRow>,
);

/// The checked header of a safetensors file (`gpuio_api::safetensors`).
#[pyfunction]
fn safetensors_header(py: Python<'_>, path: std::path::PathBuf) -> PyResult<HeaderRows> {
    let h = py
        .detach(|| gpuio_api::safetensors::SafetensorsHeader::read(&path))
        .map_err(error::to_py)?;
    let rows = h
        .tensors
        .into_iter()
        .map(|t| {
            let strides = strides(&t.shape);
            (
                t.name,
                t.dtype.to_string(),
                t.shape,
                t.bytes.start,
                t.bytes.end,
                strides,
            )
        })
        .collect();
    Ok((h.data_start, h.metadata, rows))
}

#[pymodule]
fn _gpuio(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("Error", m.py().get_type::<error::Error>())?;
    m.add_function(wrap_pyfunction!(info_json, m)?)?;
    m.add_function(wrap_pyfunction!(device_header, m)?)?;
    m.add_function(wrap_pyfunction!(checksum, m)?)?;
    m.add_function(wrap_pyfunction!(checked::crc32c_pieces, m)?)?;
    m.add_function(wrap_pyfunction!(checked::copy_checked, m)?)?;
    m.add_function(wrap_pyfunction!(safetensors_header, m)?)?;
    m.add_class::<session::Session>()?;
    m.add_class::<session::Handle>()?;
    m.add_class::<session::Lease>()?;
    m.add_class::<buffers::HostBuffer>()?;
    m.add_class::<buffers::DeviceBuffer>()?;
    m.add_class::<buffers::Resource>()?;
    m.add_class::<ondemand::PageCache>()?;
    m.add_class::<ondemand::OnDemandArray>()?;
    m.add_class::<ondemand::ResidentArray>()?;
    // The AI memory tier, `gpuio._gpuio.ai` (the Python half, `gpuio.ai`, wraps it).
    let ai = PyModule::new(m.py(), "ai")?;
    ai::register(&ai)?;
    m.add_submodule(&ai)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn strides_are_row_major_in_elements() {
        assert_eq!(super::strides(&[2, 3, 4]), [12, 4, 1]);
        assert_eq!(super::strides(&[5]), [1]);
        assert!(super::strides(&[]).is_empty());
        // As torch.empty(0, 3) and torch.empty(3, 0, 2) have them.
        assert_eq!(super::strides(&[0, 3]), [3, 1]);
        assert_eq!(super::strides(&[3, 0, 2]), [2, 2, 1]);
    }
}
