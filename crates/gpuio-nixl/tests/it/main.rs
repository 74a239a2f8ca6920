//! gpuio-nixl's integration tests: one test binary, a module per area. They need NIXL (PyPI's
//! `nixl-cu13`, which `cargo xtask ci` installs and names in `GPUIO_NIXL_LIB`): without it they
//! print why and pass, unless `GPUIO_REQUIRE_NIXL=1` makes that a failure
//! (`gpuio_testkit::Requirement`).

mod device;
mod held;
mod python;
mod transfers;

/// NIXL's library, or `None` after saying why it is missing.
#[track_caller]
fn nixl() -> Option<&'static gpuio_nixl::NixlLibrary> {
    match gpuio_nixl::library() {
        Ok(lib) => Some(lib),
        Err(e) => {
            gpuio_testkit::Requirement::Nixl.missing(e);
            None
        }
    }
}
