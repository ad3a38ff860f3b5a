//! Every kernel source compiles with NVRTC, as the GPU paths compile them at start-up. Needs
//! libnvrtc but no GPU: `scripts/test.sh` installs the `nvidia-cuda-nvrtc` wheel, puts its
//! library on LD_LIBRARY_PATH and sets TANDEM_REQUIRE_NVRTC=1, so in CI a kernel that does not
//! compile fails here instead of at the start of a GPU session. Without the library (a plain
//! `cargo test` elsewhere) the test says so and passes.

#[test]
fn every_kernel_source_compiles_with_nvrtc() {
    if !tandem_cuda::nvrtc_present() {
        assert!(
            std::env::var_os("TANDEM_REQUIRE_NVRTC").is_none(),
            "TANDEM_REQUIRE_NVRTC is set but libnvrtc cannot be loaded (LD_LIBRARY_PATH?)"
        );
        eprintln!("libnvrtc not found: kernel compilation not checked");
        return;
    }
    match tandem_cuda::compile_all_kernels() {
        Ok(sources) => assert_eq!(sources, ["kernels/llama.cu", "kernels/train.cu"]),
        Err(e) => panic!("{e}"),
    }
}
