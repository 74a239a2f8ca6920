//! The shared library's soname is cuFile's, so programs linked against NVIDIA's library (torch's
//! `DT_NEEDED libcufile.so.0`) and loaders that open it by that name (kvikio) take this one.
fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcufile.so.0");
}
