//! Building an emulator harness (a C++ file of `tests/emulated` or another crate's, compiled with
//! the kernel sources of `kernels/` and `cuda_emu.h`), shared by every emulated-kernel test
//! through `#[path]`: one place for the compiler's flags.

use std::path::Path;
use std::process::Command;

/// Compiles `source` with g++ (C++20, the kernels and the emulator on the include path) into
/// `binary`; panics with the compiler's messages when it fails.
pub fn build_harness(source: &Path, binary: &Path) {
    let tandem_cuda = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tandem-cuda");
    let built = Command::new("g++")
        .args([
            "-std=c++20",
            "-O2",
            "-pthread",
            "-Wno-unknown-pragmas",
            "-I",
        ])
        .arg(tandem_cuda.join("../../kernels"))
        .arg("-I")
        .arg(tandem_cuda.join("tests/emulated"))
        .arg("-o")
        .arg(binary)
        .arg(source)
        .output()
        .expect("g++ runs (the emulated kernel tests need g++ with C++20)");
    assert!(
        built.status.success(),
        "g++ could not build {}:\n{}",
        source.display(),
        String::from_utf8_lossy(&built.stderr)
    );
}
