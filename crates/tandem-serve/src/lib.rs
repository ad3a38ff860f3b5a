//! `tandem serve`: the speculative engine behind an OpenAI-compatible HTTP API.
//!
//! - [`protocol`]: the OpenAI wire format (requests, responses, errors) and its validation,
//!   pure functions tested without a model;
//! - [`scheduler`]: one engine thread owning the target and the head; requests join and leave
//!   the running batch between speculative rounds, a bounded queue answers 429 when full and a
//!   client that goes away frees its slot. The batch is a [`Decoder`]: the one driver on burn
//!   ([`SpecDecoder`]) or on the CUDA fast path ([`FastDecoder`]), each with or without a head;
//! - [`metrics`]: Prometheus text for `/metrics`;
//! - [`http`]: the axum routes, streaming (SSE), stop strings and graceful shutdown.

pub mod http;
pub mod metrics;
pub mod protocol;
pub mod scheduler;
pub mod text;

pub use http::{AppState, router, serve};
pub use metrics::Metrics;
pub use scheduler::{
    Decoder, EngineDecoder, Event, FastDecoder, Limits, Scheduler, SchedulerConfig, SpecDecoder,
    SubmitError,
};
