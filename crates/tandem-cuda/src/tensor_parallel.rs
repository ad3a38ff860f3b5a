//! Tensor parallelism on the fast path, the Megatron layout SGLang and vLLM shard a Llama with:
//! each rank holds its share of the attention heads (q|k|v rows, its KV heads in its own cache)
//! and of the MLP (gate|up rows), multiplies its share of o_proj's and down_proj's input columns,
//! and the partial products are summed across the ranks (the all-reduce) before the residual
//! add. The residual stream, the norms, the embedding and the lm_head are replicated, so every
//! rank holds the whole reduced residual after every block; the capture hook takes the taps
//! once, on rank 0 ([`crate::CudaTarget::load_tensor_parallel`]).
//!
//! The ranks are threads of one process, one per GPU, and the sums are NCCL's
//! (`ncclAllReduce` on each rank's stream, from `ncclCommInitAll`). One GPU cannot hold two
//! NCCL ranks, so [`TpReduction::HostSimulation`] runs the same split on one GPU with the sum
//! taken on the host in rank order: slow, and only there so the split can be tested where a
//! single GPU is all there is.

// Only to let an NCCL communicator move to its rank's thread.
#![allow(unsafe_code)]

use std::ops::Range;
use std::sync::{Arc, Condvar, Mutex, PoisonError};

use cudarc::driver::CudaSlice;
use cudarc::nccl::safe::{Comm, ReduceOp};

use crate::device::Gpu;
use crate::error::CudaError;

/// How the ranks' partial sums are added.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TpReduction {
    /// `ncclAllReduce`, one rank per GPU (the GPUs must be distinct).
    Nccl,
    /// The partial sums summed on the host in rank order (any GPUs, one included): a test
    /// stand-in for NCCL, not a way to run.
    HostSimulation,
}

impl TpReduction {
    /// `TANDEM_CUDA_TP_SIMULATE=1`: every rank on GPU 0 with [`TpReduction::HostSimulation`];
    /// otherwise NCCL over GPUs 0..ranks.
    pub fn from_env() -> Self {
        if std::env::var("TANDEM_CUDA_TP_SIMULATE").is_ok_and(|v| v == "1") {
            Self::HostSimulation
        } else {
            Self::Nccl
        }
    }
}

/// Rank `rank` of `ranks`: which slice of each split dimension it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankSplit {
    pub rank: usize,
    pub ranks: usize,
}

impl RankSplit {
    /// This rank's share of `n` (which the ranks divide: `ModelSpec::check_tensor_parallel`
    /// checks heads and intermediate size, and every split dimension is a multiple of one).
    pub fn part(&self, n: usize) -> Range<usize> {
        let per = n / self.ranks;
        self.rank * per..(self.rank + 1) * per
    }
}

/// The rows `rows` of a row-major matrix of `cols` columns (a column-parallel weight's share:
/// q|k|v's heads, gate|up's intermediate rows, a bias when `cols` is 1).
pub fn row_block(values: &[f32], cols: usize, rows: Range<usize>) -> Vec<f32> {
    values[rows.start * cols..rows.end * cols].to_vec()
}

/// The columns `take` of every row of a row-major matrix of `cols` columns (a row-parallel
/// weight's share: o_proj's and down_proj's input columns).
pub fn column_block(values: &[f32], cols: usize, take: Range<usize>) -> Vec<f32> {
    values
        .chunks(cols)
        .flat_map(|row| row[take.clone()].iter().copied())
        .collect()
}

/// `f`'s result, with a panic turned into an error: a tensor-parallel rank that panicked must
/// still release the ranks waiting for its partial sums, or the step would never end.
pub(crate) fn unwinding_as_error<T>(
    f: impl FnOnce() -> Result<T, CudaError>,
) -> Result<T, CudaError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("a panic");
        Err(CudaError::Collective(format!(
            "a tensor-parallel rank panicked: {what}"
        )))
    })
}

/// An NCCL communicator that may move to its rank's thread: NCCL allows a communicator to be
/// used from any thread, and the [`Mutex`] around it lets one thread at a time.
pub(crate) struct RankComm(Comm);

// SAFETY: see `RankComm`: the communicator is only ever used behind a mutex.
unsafe impl Send for RankComm {}

/// One rank's end of the all-reduce.
pub(crate) enum Reducer {
    /// `None` once [`Reducer::shut_down`] aborted it.
    Nccl(Mutex<Option<RankComm>>),
    Host {
        sum: Arc<HostSum>,
        rank: usize,
    },
}

impl std::fmt::Debug for Reducer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reducer::Nccl(_) => write!(f, "Reducer::Nccl"),
            Reducer::Host { rank, .. } => write!(f, "Reducer::Host(rank {rank})"),
        }
    }
}

impl Reducer {
    /// One reducer per rank: NCCL communicators over `gpus` (distinct devices), or the host
    /// sum shared by all.
    pub(crate) fn group(gpus: &[Arc<Gpu>], reduction: TpReduction) -> Result<Vec<Self>, CudaError> {
        match reduction {
            TpReduction::HostSimulation => {
                let sum = Arc::new(HostSum::new(gpus.len()));
                Ok((0..gpus.len())
                    .map(|rank| Reducer::Host {
                        sum: Arc::clone(&sum),
                        rank,
                    })
                    .collect())
            }
            TpReduction::Nccl => {
                let ordinals: Vec<usize> = gpus.iter().map(|g| g.ordinal()).collect();
                let mut distinct = ordinals.clone();
                distinct.sort_unstable();
                distinct.dedup();
                if distinct.len() != ordinals.len() {
                    return Err(CudaError::Collective(format!(
                        "NCCL holds one rank per GPU, and the ranks were given GPUs \
                         {ordinals:?}: give each rank its own GPU, or run the split on one \
                         GPU with TANDEM_CUDA_TP_SIMULATE=1 (host sums, for tests)"
                    )));
                }
                crate::collective::nccl_present()?;
                for gpu in gpus {
                    for peer in gpus {
                        gpu.share_pool_with(peer)?;
                    }
                }
                let streams = gpus.iter().map(|g| g.stream().clone()).collect();
                let comms = Comm::from_devices(streams)
                    .map_err(|e| CudaError::Collective(format!("ncclCommInitAll: {e:?}")))?;
                Ok(comms
                    .into_iter()
                    .map(|c| Reducer::Nccl(Mutex::new(Some(RankComm(c)))))
                    .collect())
            }
        }
    }

    /// Sums the first `n` values of `buffer` over the ranks, in place, on `gpu`'s stream.
    pub(crate) fn all_reduce(
        &self,
        gpu: &Gpu,
        buffer: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<(), CudaError> {
        match self {
            Reducer::Nccl(comm) => {
                let comm = comm.lock().unwrap_or_else(PoisonError::into_inner);
                let Some(comm) = comm.as_ref() else {
                    return Err(CudaError::Collective(
                        "this tensor-parallel target's NCCL communicators were aborted after \
                         a failed step: load it again"
                            .into(),
                    ));
                };
                comm.0
                    .all_reduce_in_place(&mut buffer.slice_mut(0..n), &ReduceOp::Sum)
                    .map_err(|e| CudaError::Collective(format!("ncclAllReduce: {e:?}")))?;
                Ok(())
            }
            Reducer::Host { sum, rank } => {
                let mut mine = gpu.download(buffer)?;
                mine.truncate(n);
                let total = sum.exchange(*rank, mine)?;
                gpu.upload_into(&total, buffer)
            }
        }
    }

    /// Whether a CUDA graph can hold this reduction (NCCL's kernels can be captured; the host
    /// sum waits on the host).
    pub(crate) fn capturable(&self) -> bool {
        matches!(self, Reducer::Nccl(_))
    }

    /// Tells the other ranks this one failed, so none waits for its partial sum (NCCL ranks
    /// cannot be released this way: a failed NCCL step leaves the others' GPU work waiting).
    pub(crate) fn abort(&self) {
        if let Reducer::Host { sum, .. } = self {
            sum.abort();
        }
    }

    /// Aborts this rank's NCCL communicator (`ncclCommAbort`, when cudarc drops it): after a
    /// step that failed on some rank, the others' all-reduces may wait on their GPUs for a
    /// partner that never comes, and everything queued behind them on that stream with
    /// them; the abort releases them. Later reductions are errors.
    pub(crate) fn shut_down(&self) {
        if let Reducer::Nccl(comm) = self {
            let taken = comm.lock().unwrap_or_else(PoisonError::into_inner).take();
            // cudarc's drop panics if the abort reports an error (old NCCL): the other ranks'
            // aborts must still run.
            if let Some(comm) = taken {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || drop(comm)));
            }
        }
    }

    /// Clears an aborted host sum before the next step (called with no rank in a step).
    pub(crate) fn reset(&self) {
        if let Reducer::Host { sum, .. } = self {
            sum.reset();
        }
    }
}

/// The host sum of [`TpReduction::HostSimulation`]: each rank posts its partial, waits for the
/// others, and takes the sum in rank order, so every rank gets the same bits.
pub(crate) struct HostSum {
    ranks: usize,
    state: Mutex<SumState>,
    changed: Condvar,
}

struct SumState {
    partials: Vec<Option<Vec<f32>>>,
    /// The finished sum of the current round and how many ranks have taken it.
    total: Option<Arc<Vec<f32>>>,
    taken: usize,
    aborted: bool,
}

impl HostSum {
    pub(crate) fn new(ranks: usize) -> Self {
        Self {
            ranks,
            state: Mutex::new(SumState {
                partials: vec![None; ranks],
                total: None,
                taken: 0,
                aborted: false,
            }),
            changed: Condvar::new(),
        }
    }

    fn exchange(&self, rank: usize, partial: Vec<f32>) -> Result<Vec<f32>, CudaError> {
        let aborted =
            || CudaError::Collective("another tensor-parallel rank failed during this step".into());
        let mut state = self.state.lock().expect("a rank panicked in the host sum");
        // A rank that comes back for the next round waits until the last one has its sum.
        while state.total.is_some() && !state.aborted {
            state = self.changed.wait(state).expect("host sum");
        }
        if state.aborted {
            return Err(aborted());
        }
        state.partials[rank] = Some(partial);
        if state.partials.iter().all(Option::is_some) {
            let mut parts = state
                .partials
                .iter_mut()
                .map(|p| p.take().expect("all posted"));
            let mut total = parts.next().expect("at least one rank");
            for part in parts {
                if part.len() != total.len() {
                    state.aborted = true;
                    self.changed.notify_all();
                    return Err(CudaError::Collective(format!(
                        "tensor-parallel partial sums of {} and {} values",
                        total.len(),
                        part.len()
                    )));
                }
                for (t, p) in total.iter_mut().zip(&part) {
                    *t += p;
                }
            }
            state.total = Some(Arc::new(total));
            self.changed.notify_all();
        }
        while state.total.is_none() && !state.aborted {
            state = self.changed.wait(state).expect("host sum");
        }
        if state.aborted {
            return Err(aborted());
        }
        let total = state.total.as_ref().expect("summed").as_ref().clone();
        state.taken += 1;
        if state.taken == self.ranks {
            state.total = None;
            state.taken = 0;
            self.changed.notify_all();
        }
        Ok(total)
    }

    fn abort(&self) {
        let mut state = self.state.lock().expect("a rank panicked in the host sum");
        state.aborted = true;
        self.changed.notify_all();
    }

    /// Forgets an aborted round: its partials, its sum, the abort.
    fn reset(&self) {
        let mut state = self.state.lock().expect("a rank panicked in the host sum");
        state.partials.iter_mut().for_each(|p| *p = None);
        state.total = None;
        state.taken = 0;
        state.aborted = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The identity the whole split rests on, by hand: with `W` split by input columns and `x`
    /// by the same columns, the ranks' partial products `x_r W_r^T` add up to `x W^T`.
    #[test]
    fn row_parallel_partial_products_sum_to_the_whole_product() {
        // W: 2 outputs x 4 inputs, x: 4 inputs.
        let w = [1.0, 2.0, 3.0, 4.0, -1.0, 0.5, 2.0, -3.0];
        let x = [0.5, -1.0, 2.0, 2.0];
        let whole: Vec<f32> = w
            .chunks(4)
            .map(|row| row.iter().zip(&x).map(|(a, b)| a * b).sum())
            .collect();
        assert_eq!(whole, vec![12.5, -3.0]);
        let mut sum = [0.0f32; 2];
        for rank in 0..2 {
            let split = RankSplit { rank, ranks: 2 };
            let cols = split.part(4);
            let w_r = column_block(&w, 4, cols.clone());
            assert_eq!(w_r.len(), 4);
            for (o, row) in w_r.chunks(2).enumerate() {
                sum[o] += row
                    .iter()
                    .zip(&x[cols.clone()])
                    .map(|(a, b)| a * b)
                    .sum::<f32>();
            }
        }
        assert_eq!(sum.to_vec(), whole);
        // Rank 1 holds columns 2..4 of each row.
        let split = RankSplit { rank: 1, ranks: 2 };
        assert_eq!(
            column_block(&w, 4, split.part(4)),
            vec![3.0, 4.0, 2.0, -3.0]
        );
        // Column-parallel: rank 1 of 2 holds output row 1 of a 2-row matrix.
        assert_eq!(row_block(&w, 4, split.part(2)), vec![-1.0, 0.5, 2.0, -3.0]);
    }

    #[test]
    fn rank_parts_tile_the_dimension() {
        let parts: Vec<Range<usize>> = (0..3)
            .map(|rank| RankSplit { rank, ranks: 3 }.part(12))
            .collect();
        assert_eq!(parts, vec![0..4, 4..8, 8..12]);
    }

    /// Three threads post partials for two rounds; each gets the rank-order sum of its round,
    /// the same bits on every rank, and a rank that runs ahead waits for the round to finish.
    #[test]
    fn host_sum_gives_every_rank_the_rank_order_sum_each_round() {
        let sum = Arc::new(HostSum::new(3));
        let threads: Vec<_> = (0..3)
            .map(|rank| {
                let sum = Arc::clone(&sum);
                std::thread::spawn(move || {
                    (0..2)
                        .map(|round| {
                            let partial = vec![(rank + 1) as f32 * 10f32.powi(round), 0.1];
                            sum.exchange(rank, partial).unwrap()
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let results: Vec<Vec<Vec<f32>>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        let expected_tail = 0.1f32 + 0.1 + 0.1;
        for rounds in &results {
            assert_eq!(rounds[0], vec![6.0, expected_tail]);
            assert_eq!(rounds[1], vec![60.0, expected_tail]);
        }
    }

    #[test]
    fn a_panicking_rank_becomes_an_error_naming_the_panic() {
        let err = unwinding_as_error::<()>(|| panic!("rank 1 ran out of memory"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("a tensor-parallel rank panicked: rank 1 ran out of memory"),
            "{err}"
        );
        assert_eq!(unwinding_as_error(|| Ok(7)).unwrap(), 7);
    }

    #[test]
    fn an_aborted_rank_releases_the_waiting_ones_with_an_error() {
        let sum = Arc::new(HostSum::new(2));
        let waiter = {
            let sum = Arc::clone(&sum);
            std::thread::spawn(move || sum.exchange(0, vec![1.0]))
        };
        std::thread::sleep(std::time::Duration::from_millis(100));
        sum.abort();
        let err = waiter.join().unwrap().unwrap_err().to_string();
        assert!(err.contains("another tensor-parallel rank failed"), "{err}");
    }

    /// A step that failed (rank 0 posted its partial, then rank 1 aborted) must not leave the
    /// next step failing, nor summing the stale partial into it.
    #[test]
    fn a_reset_host_sum_serves_the_next_step_without_the_failed_ones_partials() {
        let sum = Arc::new(HostSum::new(2));
        let posted = {
            let sum = Arc::clone(&sum);
            std::thread::spawn(move || sum.exchange(0, vec![100.0]))
        };
        std::thread::sleep(std::time::Duration::from_millis(100));
        sum.abort();
        assert!(posted.join().unwrap().is_err());
        assert!(
            sum.exchange(1, vec![1.0]).is_err(),
            "still aborted before the reset"
        );
        sum.reset();
        let other = {
            let sum = Arc::clone(&sum);
            std::thread::spawn(move || sum.exchange(1, vec![2.0]))
        };
        assert_eq!(sum.exchange(0, vec![1.0]).unwrap(), vec![3.0]);
        assert_eq!(other.join().unwrap().unwrap(), vec![3.0]);
    }
}
