//! CUDA graphs of decode-sized steps, shared by the target ([`crate::CudaTarget`]) and the
//! draft head ([`crate::CudaDraft`]): which step shapes were seen and captured, and the buffers
//! each graph was captured over.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use tandem_wiring::TapId;

use crate::cache::CudaKvCache;
use crate::device::{AttentionShape, Gpu, StepGraph};

/// Graphs a model keeps (step shapes times caches); the oldest goes first.
const MAX_GRAPHS: usize = 128;

/// Steps of one key that run eagerly before the next one is captured. A running batch moves
/// its caches to new buffers whenever a request joins or leaves (a new key), so under churn a
/// key may live only a few rounds: waiting two steps means a capture (about the cost of an eager
/// step plus instantiation) is only paid for keys that have already proved stable.
const EAGER_STEPS_BEFORE_CAPTURE: u32 = 2;

/// How much of the work ran from graphs ([`crate::CudaTarget::graph_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GraphStats {
    pub captured: usize,
    pub replays: usize,
}

/// What a graph was captured for: the step's shape and outputs, and the cache buffers its
/// launches write (a cache reallocated elsewhere is another key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct GraphKey {
    pub batch: usize,
    pub width: usize,
    pub capacity: usize,
    pub logits_for: u8,
    pub taps: Vec<TapId>,
    pub cache: Vec<u64>,
    /// Whether the step ran the fused small-step kernels (a graph replays the launches it was
    /// captured with, so turning fusion off must not replay a fused graph).
    pub fused: bool,
    /// Whether the step ran the persistent one-launch step.
    pub persistent: bool,
    /// Whether the step's q|k|v and attention ran as one launch a layer.
    pub qkv_attention: bool,
    /// Whether the step took the injected partial-sum tap (its graph copies another buffer
    /// into the tap).
    pub partial_fault: bool,
    /// Whether the step's MLPs ran as one launch a layer (`Gpu::mlp_partials`).
    pub mlp_partials: bool,
}

impl GraphKey {
    /// The key of a step of `shape` over `cache` with these outputs (`logits_for` and `taps`
    /// as the model names them; the head has neither).
    pub fn new(
        gpu: &Gpu,
        shape: AttentionShape,
        cache: &CudaKvCache,
        logits_for: u8,
        taps: &[TapId],
    ) -> Self {
        Self {
            batch: shape.batch,
            width: shape.width,
            capacity: shape.capacity,
            logits_for,
            taps: taps.to_vec(),
            cache: cache.addresses(gpu),
            fused: false,
            persistent: false,
            qkv_attention: false,
            partial_fault: false,
            mlp_partials: false,
        }
    }

    /// The key of a step that ran (or did not run) the fused small-step kernels.
    pub fn with_fused(self, fused: bool) -> Self {
        Self { fused, ..self }
    }

    /// The key of a step that ran (or did not run) the persistent step.
    pub fn with_persistent(self, persistent: bool) -> Self {
        Self { persistent, ..self }
    }

    /// The key of a step whose q|k|v and attention ran (or did not run) as one launch a layer.
    pub fn with_qkv_attention(self, qkv_attention: bool) -> Self {
        Self {
            qkv_attention,
            ..self
        }
    }

    /// The key of a step whose MLPs ran (or did not run) as one launch a layer.
    pub fn with_mlp_partials(self, mlp_partials: bool) -> Self {
        Self {
            mlp_partials,
            ..self
        }
    }

    /// The key of a step that took (or did not take) the injected partial-sum tap.
    pub fn with_partial_fault(self, partial_fault: bool) -> Self {
        Self {
            partial_fault,
            ..self
        }
    }
}

/// A model's graphs: whether its decode-sized steps use them, and those captured so far.
pub(crate) struct Graphs<B> {
    on: AtomicBool,
    cache: Mutex<GraphCache<B>>,
}

impl<B> Graphs<B> {
    pub fn new(on: bool) -> Self {
        Self {
            on: AtomicBool::new(on),
            cache: Mutex::new(GraphCache::default()),
        }
    }

    pub fn enabled(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Turns graphs on or off; off also drops those captured.
    pub fn set(&self, on: bool) {
        self.on.store(on, Ordering::Relaxed);
        if !on {
            self.lock().clear();
        }
    }

    pub fn stats(&self) -> GraphStats {
        self.lock().stats
    }

    /// The cache, also after a panic while it was held (a tensor-parallel rank's panic is
    /// turned into an error, and the target is dropped afterwards: a second panic there
    /// would abort the process).
    pub fn lock(&self) -> MutexGuard<'_, GraphCache<B>> {
        self.cache.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// One captured step: its graph and the buffers the graph reads and writes.
pub(crate) struct CapturedStep<B> {
    pub buffers: B,
    pub graph: StepGraph,
    pub visited: Vec<TapId>,
}

/// The captured steps of a model, and how often each key not yet captured was seen.
pub(crate) struct GraphCache<B> {
    seen: HashMap<GraphKey, u32>,
    pub captured: HashMap<GraphKey, CapturedStep<B>>,
    order: VecDeque<GraphKey>,
    pub stats: GraphStats,
    /// The graph replayed last (`CudaTarget::time_last_replay` replays it again).
    pub last: Option<GraphKey>,
}

impl<B> Default for GraphCache<B> {
    fn default() -> Self {
        Self {
            seen: HashMap::new(),
            captured: HashMap::new(),
            order: VecDeque::new(),
            stats: GraphStats::default(),
            last: None,
        }
    }
}

impl<B> GraphCache<B> {
    /// Whether a step of `key` should run from a graph (captured already, or now after
    /// [`EAGER_STEPS_BEFORE_CAPTURE`] eager steps); counts the step.
    pub fn ready(&mut self, key: &GraphKey) -> bool {
        if self.captured.contains_key(key) {
            return true;
        }
        if self.seen.len() >= 4 * MAX_GRAPHS {
            self.seen.clear();
        }
        let count = self.seen.entry(key.clone()).or_insert(0);
        *count += 1;
        *count > EAGER_STEPS_BEFORE_CAPTURE
    }

    pub fn insert(&mut self, key: GraphKey, step: CapturedStep<B>) {
        while self.order.len() >= MAX_GRAPHS {
            if let Some(old) = self.order.pop_front() {
                self.captured.remove(&old);
            }
        }
        self.seen.remove(&key);
        self.order.push_back(key.clone());
        self.captured.insert(key, step);
        self.stats.captured += 1;
    }

    pub fn clear(&mut self) {
        self.seen.clear();
        self.captured.clear();
        self.order.clear();
    }
}
