//! The speculative decoding loop, split by role (as mistral.rs does): the driver, written once
//! ([`driver`]), over what it needs from a device ([`backend`]: burn and the CUDA fast path);
//! the draft tree and its verification mask ([`tree`]), the acceptance rules ([`verify`]:
//! greedy and lossless sampling), acceptance statistics ([`stats`]) and the speculation policy
//! ([`policy`]). The tree, verification, statistics and policy are pure host functions, so the
//! math that decides correctness is unit-tested on tiny hand-made cases.

pub mod admission;
pub mod backend;
pub mod driver;
pub mod engine;
pub mod fast;
pub mod policy;
pub mod stats;
pub mod trace;
pub mod tree;
pub mod verify;
pub mod wiring;

pub use admission::Admission;
pub use backend::SpecBackend;
pub use driver::{Engine, Roots, RunningBatch, early_extend_default};
pub use engine::{
    BatchOutput, Finish, InferError, Progress, Request, SpecConfig, SpecEngine, SpecGenerate,
    SpecOutput, Timings,
};
pub use fast::{FastRunningBatch, FastSpecEngine, fast_target_generate};
pub use policy::{Choice, CostTable, PolicyConfig, Shape, SpeculationPolicy};
pub use stats::{
    AcceptanceStats, PairedRun, accept_length_se, pooled_speedup, position_se, ratio_se, share_se,
    speedup_se,
};
pub use trace::RoundRecord;
pub use tree::{BeamSearch, BeamStep, DraftStep, DraftTree, TreeBuilder, TreeError};
pub use verify::{Acceptance, verify_greedy, verify_sampling};
