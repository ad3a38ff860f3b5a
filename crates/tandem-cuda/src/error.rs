use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;
use cudarc::nvrtc::CompileError;
use tandem_model::ModelError;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no usable CUDA device: {0} (the fast path needs an NVIDIA GPU and its driver)")]
    NoDevice(DriverError),
    #[error(
        "{0} cannot be loaded: the fast path needs an NVIDIA GPU with its driver and the CUDA libraries on LD_LIBRARY_PATH"
    )]
    MissingLibrary(&'static str),
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] DriverError),
    #[error("cuBLAS call failed: {0}")]
    Blas(#[from] CublasError),
    #[error("NVRTC could not compile the CUDA kernels (the log names the file): {0}")]
    Compile(#[from] CompileError),
    /// A kernel that cannot be assembled or run on this GPU (the message says which and why).
    #[error("{0}")]
    Kernel(String),
    #[error("the CUDA fast path does not support {what} (model {architecture}); use the burn path")]
    Unsupported { what: String, architecture: String },
    /// The head trainer cannot go on (its inputs, or what the GPU can hold).
    #[error("{0}")]
    Trainer(String),
    /// Joining or using the replicas' NCCL communicator.
    #[error("data-parallel replicas: {0}")]
    Collective(String),
    #[error(transparent)]
    Model(#[from] ModelError),
}
