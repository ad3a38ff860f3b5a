//! Recycled KV-cache buffers. A CUDA graph is keyed by the addresses of the cache buffers its
//! launches write ([`crate::graphs`]), so a request that gets a freshly allocated cache replays
//! nothing: every step shape warms up eagerly and is captured again. `tandem bench` and any
//! caller that runs one request after another paid that at every prompt (a verification, four
//! extend widths and a chain step at batch 1). Caches of one model and shape now hand their
//! buffers back here when dropped, as one set in their order, and the next cache of that shape
//! takes the same set back: the same addresses, so the graphs captured over them replay.
//! Engines round capacities up ([`cache_columns`]) so that requests of different lengths
//! share a shape.

use std::collections::VecDeque;
use std::sync::Mutex;

use cudarc::driver::CudaSlice;

/// Columns a pooled cache's capacity is rounded up to a multiple of ([`cache_columns`]).
pub const CACHE_COLUMNS_STEP: usize = 512;

/// Bytes of idle buffers the pool keeps by default (`TANDEM_CUDA_KV_POOL_MIB` overrides it; 0
/// turns the pool off). A set that does not fit is freed as before.
const DEFAULT_POOL_BYTES: usize = 4 << 30;

/// The cache capacity to allocate for `columns` wanted ones: the next multiple of
/// [`CACHE_COLUMNS_STEP`], so that caches of similar requests have one shape.
pub fn cache_columns(columns: usize) -> usize {
    columns.max(1).div_ceil(CACHE_COLUMNS_STEP) * CACHE_COLUMNS_STEP
}

/// Idle buffer sets, oldest first.
pub(crate) struct KvPool {
    sets: Mutex<VecDeque<Vec<CudaSlice<u16>>>>,
    limit_bytes: usize,
}

impl KvPool {
    pub fn from_env() -> Self {
        let limit_bytes = std::env::var("TANDEM_CUDA_KV_POOL_MIB")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .map_or(DEFAULT_POOL_BYTES, |mib| mib << 20);
        Self::new(limit_bytes)
    }

    pub fn new(limit_bytes: usize) -> Self {
        Self {
            sets: Mutex::new(VecDeque::new()),
            limit_bytes,
        }
    }

    /// The oldest idle set of `count` buffers of `len` values each, if any. Oldest first, so
    /// that caches of one shape made and dropped in the same order (a target-only and a
    /// speculative cache side by side, one request after another) get the same sets back.
    pub fn take(&self, count: usize, len: usize) -> Option<Vec<CudaSlice<u16>>> {
        let mut sets = self.sets.lock().expect("kv pool lock");
        let at = sets.iter().position(|set| fits(set, count, len))?;
        sets.remove(at)
    }

    /// Keeps `set` for the next cache of its shape; the oldest sets go when the pool would hold
    /// more than its limit (a set larger than the limit is dropped at once).
    pub fn put(&self, set: Vec<CudaSlice<u16>>) {
        if set.is_empty() || bytes(&set) > self.limit_bytes {
            return;
        }
        let mut sets = self.sets.lock().expect("kv pool lock");
        sets.push_back(set);
        while sets.iter().map(|s| bytes(s)).sum::<usize>() > self.limit_bytes {
            sets.pop_front();
        }
    }

    /// Idle sets held now.
    pub fn idle_sets(&self) -> usize {
        self.sets.lock().expect("kv pool lock").len()
    }
}

fn fits(set: &[CudaSlice<u16>], count: usize, len: usize) -> bool {
    set.len() == count && set.iter().all(|b| b.len() == len)
}

fn bytes(set: &[CudaSlice<u16>]) -> usize {
    set.iter().map(|b| 2 * b.len()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacities_round_up_to_whole_steps() {
        assert_eq!(cache_columns(0), CACHE_COLUMNS_STEP);
        assert_eq!(cache_columns(1), CACHE_COLUMNS_STEP);
        assert_eq!(cache_columns(CACHE_COLUMNS_STEP), CACHE_COLUMNS_STEP);
        assert_eq!(
            cache_columns(CACHE_COLUMNS_STEP + 1),
            2 * CACHE_COLUMNS_STEP
        );
        // Two prompts of different lengths (bench: prompt + 129 * 4 + 1) share one shape.
        assert_eq!(cache_columns(60 + 517), cache_columns(300 + 517));
    }
}
