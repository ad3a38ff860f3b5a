//! One engine thread owns the target and the head (a GPU context and its tensors stay on one
//! thread). Between speculative rounds it admits queued requests into the running batch, drops
//! the ones whose client went away, and streams each request's committed tokens back over its
//! own channel. The queue in front of it is bounded: a full queue is answered 429 at once.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::JoinHandle;

use tandem_cuda::CudaTarget;
use tandem_infer::{
    CostTable, Engine, InferError, PolicyConfig, Progress, Request, RunningBatch, SpecBackend,
    SpecConfig, SpecOutput, SpeculationPolicy,
};
use tandem_model::{TapRequest, TargetModel};
use tokio::sync::mpsc;

use crate::metrics::{Metrics, Outcome};

/// A running batch the scheduler can drive: the speculative engine or the target alone.
pub trait Decoder {
    /// Refuses a request the engine cannot run (before it joins).
    fn check(&self, request: &Request) -> Result<(), InferError>;
    fn admit(&mut self, requests: Vec<Request>) -> Result<Vec<Progress>, InferError>;
    fn step(&mut self) -> Result<Vec<Progress>, InferError>;
    /// Takes a request out of the batch (its output so far); an error leaves the batch in an
    /// unknown state, and the scheduler fails the running requests.
    fn cancel(&mut self, id: u64) -> Result<Option<SpecOutput>, InferError>;
    fn running(&self) -> usize;
    fn limits(&self) -> Limits;
    /// Rounds run so far by draft shape (`none`: no drafts), for engines whose speculation
    /// policy chooses the shape per round.
    fn policy_rounds(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
    /// Where the engine's time went, printed when the server stops (`None`: nothing to say).
    fn report(&self) -> Option<String> {
        None
    }
}

/// What the HTTP layer needs to validate requests before queueing them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Token columns per sequence (prompt + generated + one round).
    pub context: usize,
    /// The longest prompt accepted.
    pub max_prompt: usize,
    /// Columns one round needs beyond the committed tokens.
    pub round: usize,
    /// Draft depth (0 for target-only).
    pub draft_depth: usize,
}

/// The target, its head and the serving settings a decoder owns; [`Model::engine`] borrows
/// them as the driver's [`Engine`] (apart from the batch, which rounds change).
struct Model<T: SpecBackend> {
    target: T,
    draft: Option<T::Head>,
    taps: TapRequest,
    config: SpecConfig,
}

impl<T: SpecBackend> Model<T> {
    fn engine(&self) -> Engine<'_, T> {
        Engine {
            target: &self.target,
            draft: self.draft.as_ref(),
            taps: self.taps.clone(),
            config: self.config,
        }
    }
}

/// The speculative driver over an owned target and head on any backend, or the target alone
/// (`draft: None`, the baseline `tandem serve --no-draft` runs), with continuous batching.
pub struct EngineDecoder<T: SpecBackend> {
    model: Model<T>,
    batch: RunningBatch<T>,
    /// Where [`Decoder::report`] writes the record of every round (`--round-log`).
    round_log: Option<std::path::PathBuf>,
}

/// The burn engine's decoder (CPU in tests).
pub type SpecDecoder<B> = EngineDecoder<TargetModel<B>>;
/// The CUDA fast path's decoder (serving on the GPU).
pub type FastDecoder = EngineDecoder<CudaTarget>;

impl<T: SpecBackend> EngineDecoder<T> {
    /// `taps`: the serving taps checked against the head's manifest ([`TapRequest::none`]
    /// without a head). `policy`: how rounds choose their draft shape (`None`: always
    /// `config`'s). `max_batch`: the caches are allocated for that many sequences at once (0:
    /// as many as join).
    pub fn new(
        target: T,
        draft: Option<T::Head>,
        taps: TapRequest,
        config: SpecConfig,
        context: usize,
        policy: Option<SpeculationPolicy>,
        max_batch: usize,
    ) -> Result<Self, InferError> {
        config.validate()?;
        let model = Model {
            target,
            draft,
            taps,
            config,
        };
        let engine = model.engine();
        let mut batch = match policy {
            Some(policy) => engine.new_batch_with_policy(context, policy),
            None => engine.new_batch(context),
        };
        batch.reserve_rows = max_batch;
        Ok(Self {
            model,
            batch,
            round_log: None,
        })
    }

    /// Records every round and admission from now on (calibration's are dropped) and writes
    /// them as CSV to `path` when the server stops ([`tandem_infer::RoundRecord`]).
    pub fn log_rounds(&mut self, path: std::path::PathBuf) {
        self.batch.record_rounds();
        self.round_log = Some(path);
    }

    /// Writes the round log, whole or not at all (a temporary name, then renamed).
    fn write_round_log(&self, path: &std::path::Path) -> std::io::Result<usize> {
        let records = self.batch.round_records();
        let partial = path.with_extension("csv.partial");
        std::fs::write(&partial, tandem_infer::trace::to_csv(records))?;
        std::fs::rename(&partial, path)?;
        Ok(records.len())
    }

    /// Measures the cost of every choice of the batch's policy (plain rounds and each draft
    /// shape) at `batches` sizes on the decoder's own caches, so the CUDA graphs captured while
    /// measuring are the ones serving replays, then lets the adaptive policy choose each round.
    pub fn calibrate(
        &mut self,
        batches: &[usize],
        config: PolicyConfig,
    ) -> Result<CostTable, InferError> {
        let shapes = self.batch.policy.shapes().to_vec();
        let costs = self.model.engine().calibrate(&mut self.batch, batches)?;
        self.batch.policy = SpeculationPolicy::adaptive(shapes, costs.clone(), config)?;
        Ok(costs)
    }
}

impl<T: SpecBackend> Decoder for EngineDecoder<T> {
    fn check(&self, request: &Request) -> Result<(), InferError> {
        self.model.engine().check_request(&self.batch, request)
    }
    fn admit(&mut self, requests: Vec<Request>) -> Result<Vec<Progress>, InferError> {
        self.model.engine().admit(&mut self.batch, requests)
    }
    fn step(&mut self) -> Result<Vec<Progress>, InferError> {
        self.model.engine().step(&mut self.batch)
    }
    fn cancel(&mut self, id: u64) -> Result<Option<SpecOutput>, InferError> {
        self.model.engine().cancel(&mut self.batch, id)
    }
    fn running(&self) -> usize {
        self.batch.len()
    }
    fn report(&self) -> Option<String> {
        let t = &self.batch.timings;
        let mut text = format!(
            "engine time: prefill {:.2}s, draft {:.2}s, verify {:.2}s, extend {:.2}s, catch-up \
             {:.2}s, housekeeping {:.2}s (compaction {:.2}s, head rows {:.2}s, head roots \
             {:.2}s) (wall: rounds {:.2}s, admissions {:.2}s); {} compactions, {} retirements",
            t.prefill_s,
            t.draft_s,
            t.verify_s,
            t.extend_s,
            t.catch_up_s,
            t.housekeeping_s,
            t.compact_s,
            t.head_retain_s,
            t.head_roots_s,
            t.rounds_wall_s,
            t.admits_wall_s,
            self.batch.compactions,
            self.batch.retirements,
        );
        if let Some(graphs) = self.model.target.graph_report(self.model.draft.as_ref()) {
            text.push_str(&format!("; {graphs}"));
        }
        if self.model.draft.is_some() && self.batch.policy.is_adaptive() {
            text.push_str(&format!(
                "\nspeculation policy at the end: {}",
                self.batch.policy.summary()
            ));
        }
        if let Some(path) = &self.round_log {
            match self.write_round_log(path) {
                Ok(n) => text.push_str(&format!("\nround log: {n} records in {}", path.display())),
                Err(e) => text.push_str(&format!(
                    "\nround log: could not write {}: {e}",
                    path.display()
                )),
            }
        }
        Some(text)
    }
    fn policy_rounds(&self) -> Vec<(String, u64)> {
        match self.model.draft {
            Some(_) => self.batch.policy.rounds(),
            None => Vec::new(),
        }
    }
    fn limits(&self) -> Limits {
        let (round, draft_depth) = match self.model.draft {
            Some(_) => (
                self.batch.policy.max_tokens(),
                self.batch.policy.max_steps(),
            ),
            None => (1, 0),
        };
        Limits {
            context: self.batch.capacity(),
            max_prompt: self.model.engine().max_prompt_len(&self.batch),
            round,
            draft_depth,
        }
    }
}

/// What the engine thread sends a request's handler.
#[derive(Debug, Clone)]
pub enum Event {
    /// Tokens committed in one round (`accepted`: draft tokens accepted in it).
    Tokens {
        tokens: Vec<u32>,
        accepted: Option<usize>,
    },
    /// The request finished; its full output and statistics.
    Finished(SpecOutput),
    /// The engine refused or failed the request.
    Failed { message: String, invalid: bool },
}

struct Job {
    request: Request,
    events: mpsc::UnboundedSender<Event>,
}

#[derive(Debug, Clone, Copy)]
pub struct SchedulerConfig {
    /// Sequences in the running batch at most.
    pub max_batch: usize,
    /// Requests waiting to join at most; more are answered 429.
    pub max_queue: usize,
    /// Rounds a join may be held back so that it prefills together with the next ones
    /// ([`join_waits`]); 0 admits every request at the first round boundary.
    pub join_hold_rounds: usize,
}

/// A join is held back while it brings fewer than one row for every `JOIN_SHARE` running
/// rows. Why: on the H200 a one-prompt admission at c=32 cost ~3.6 ms, about 1.5 rounds of the
/// whole batch (session 33's round logs), while each empty row costs only its own share of a
/// round. Speculative rows finish in different rounds, so without holding they rejoin one
/// prompt at a time.
const JOIN_SHARE: usize = 8;

/// Whether `waiting` requests stay out of the batch for one more round: they have waited
/// `rounds_waited` rounds of at most `hold_rounds`, and they are few next to the `running`
/// rows. An idle or small batch never waits, so latency at low concurrency is unchanged.
pub fn join_waits(
    hold_rounds: usize,
    running: usize,
    waiting: usize,
    rounds_waited: usize,
) -> bool {
    waiting > 0 && rounds_waited < hold_rounds && waiting * JOIN_SHARE < running
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SubmitError {
    #[error("the request queue ({0}) is full")]
    QueueFull(usize),
    #[error("the server is shutting down")]
    ShuttingDown,
}

/// The handle the HTTP layer submits requests through. Dropping every handle lets the engine
/// thread finish the running requests and exit.
#[derive(Clone)]
pub struct Scheduler {
    queue: mpsc::Sender<Job>,
    next_id: Arc<AtomicU64>,
    config: SchedulerConfig,
    pub limits: Limits,
    pub metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Scheduler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scheduler")
            .field("config", &self.config)
            .field("limits", &self.limits)
            .finish()
    }
}

/// Builds the decoder on the engine thread (models are loaded where they run).
pub type DecoderFactory = Box<dyn FnOnce() -> Result<Box<dyn Decoder>, String> + Send + 'static>;

impl Scheduler {
    /// Starts the engine thread and waits until the decoder is loaded (a load error, e.g. a
    /// wiring mismatch, is returned here and nothing is served).
    pub fn spawn(
        config: SchedulerConfig,
        make_decoder: DecoderFactory,
    ) -> Result<(Self, JoinHandle<()>), String> {
        if config.max_batch == 0 || config.max_queue == 0 {
            return Err("max_batch and max_queue must be at least 1".into());
        }
        let (queue, jobs) = mpsc::channel::<Job>(config.max_queue);
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("tandem-engine".into())
            .spawn(move || {
                let decoder = match make_decoder() {
                    Ok(d) => d,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                let limits = decoder.limits();
                let metrics = Arc::new(Metrics::new(limits.draft_depth + 1));
                let _ = ready_tx.send(Ok((limits, metrics.clone())));
                run_engine(decoder, jobs, config, &metrics);
            })
            .map_err(|e| format!("cannot start the engine thread: {e}"))?;
        let (limits, metrics) = ready_rx
            .recv()
            .map_err(|_| "the engine thread died while loading".to_owned())??;
        Ok((
            Self {
                queue,
                next_id: Arc::new(AtomicU64::new(1)),
                config,
                limits,
                metrics,
            },
            thread,
        ))
    }

    /// Queues `request` (its id is assigned here); events arrive on the returned channel.
    /// Dropping the receiver cancels the request.
    pub fn submit(
        &self,
        mut request: Request,
    ) -> Result<mpsc::UnboundedReceiver<Event>, SubmitError> {
        request.id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = mpsc::unbounded_channel();
        self.queue
            .try_send(Job { request, events })
            .map_err(|e| match e {
                mpsc::error::TrySendError::Full(_) => SubmitError::QueueFull(self.config.max_queue),
                mpsc::error::TrySendError::Closed(_) => SubmitError::ShuttingDown,
            })?;
        Ok(rx)
    }
}

fn run_engine(
    mut decoder: Box<dyn Decoder>,
    mut jobs: mpsc::Receiver<Job>,
    config: SchedulerConfig,
    metrics: &Metrics,
) {
    let mut live: HashMap<u64, mpsc::UnboundedSender<Event>> = HashMap::new();
    let mut closed = false;
    // Requests held back from the batch (`join_waits`) and the rounds they have waited.
    let mut held: Vec<Job> = Vec::new();
    let mut held_rounds = 0;
    // Wall time of loop iterations with requests in flight, outside the decoder's admissions
    // and rounds (delivery, cancellation, queue handling): reported at shutdown.
    let mut between_rounds_s = 0.0;
    loop {
        let mut incoming = std::mem::take(&mut held);
        if live.is_empty() && incoming.is_empty() {
            if closed {
                break;
            }
            match jobs.blocking_recv() {
                Some(job) => incoming.push(job),
                None => break,
            }
        }
        let iteration = std::time::Instant::now();
        let mut in_decoder = 0.0;
        while !closed && live.len() + incoming.len() < config.max_batch {
            match jobs.try_recv() {
                Ok(job) => incoming.push(job),
                Err(mpsc::error::TryRecvError::Empty) => break,
                Err(mpsc::error::TryRecvError::Disconnected) => closed = true,
            }
        }
        incoming.retain(|job| {
            let gone = job.events.is_closed();
            if gone {
                metrics.request_done(Outcome::Cancelled);
            }
            !gone
        });
        if join_waits(
            config.join_hold_rounds,
            decoder.running(),
            incoming.len(),
            held_rounds,
        ) {
            held = std::mem::take(&mut incoming);
        } else {
            held_rounds = 0;
        }

        let mut admitted = Vec::new();
        for job in incoming {
            if let Err(e) = decoder.check(&job.request) {
                let _ = job.events.send(Event::Failed {
                    message: e.to_string(),
                    invalid: true,
                });
                continue;
            }
            metrics.prompt_tokens(job.request.prompt.len());
            live.insert(job.request.id, job.events);
            admitted.push(job.request);
        }
        if !admitted.is_empty() {
            let ids: Vec<u64> = admitted.iter().map(|r| r.id).collect();
            let t0 = std::time::Instant::now();
            let admitted = decoder.admit(admitted);
            in_decoder += t0.elapsed().as_secs_f64();
            match admitted {
                Ok(progress) => deliver(progress, &mut live, metrics),
                Err(e) => fail(&ids, &e, &mut live, &mut *decoder, metrics),
            }
        }

        let gone: Vec<u64> = live
            .iter()
            .filter(|(_, tx)| tx.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in gone {
            match decoder.cancel(id) {
                Ok(out) => {
                    if let Some(out) = out {
                        metrics.acceptance(&out.stats);
                    }
                    live.remove(&id);
                    metrics.request_done(Outcome::Cancelled);
                }
                Err(e) => {
                    live.remove(&id);
                    metrics.request_done(Outcome::Cancelled);
                    let ids: Vec<u64> = live.keys().copied().collect();
                    fail(&ids, &e, &mut live, &mut *decoder, metrics);
                }
            }
        }

        if decoder.running() > 0 {
            let t0 = std::time::Instant::now();
            let stepped = decoder.step();
            in_decoder += t0.elapsed().as_secs_f64();
            match stepped {
                Ok(progress) => {
                    deliver(progress, &mut live, metrics);
                    metrics.set_policy_rounds(decoder.policy_rounds());
                    if !held.is_empty() {
                        held_rounds += 1;
                    }
                }
                Err(e) => {
                    let ids: Vec<u64> = live.keys().copied().collect();
                    fail(&ids, &e, &mut live, &mut *decoder, metrics);
                }
            }
        }
        metrics.set_queue(jobs.len() + held.len(), decoder.running());
        between_rounds_s += iteration.elapsed().as_secs_f64() - in_decoder;
    }
    if let Some(report) = decoder.report() {
        eprintln!("tandem serve: {report}");
    }
    eprintln!("tandem serve: scheduler time outside the decoder: {between_rounds_s:.2}s");
}

fn deliver(
    progress: Vec<Progress>,
    live: &mut HashMap<u64, mpsc::UnboundedSender<Event>>,
    metrics: &Metrics,
) {
    for p in progress {
        metrics.generated(p.tokens.len());
        if let Some(accepted) = p.accepted {
            metrics.round(accepted);
        }
        let Some(tx) = live.get(&p.id) else { continue };
        if !p.tokens.is_empty() || p.accepted.is_some() {
            let _ = tx.send(Event::Tokens {
                tokens: p.tokens,
                accepted: p.accepted,
            });
        }
        if let Some(out) = p.finished {
            metrics.acceptance(&out.stats);
            let _ = tx.send(Event::Finished(out));
            live.remove(&p.id);
        }
    }
}

/// An engine error fails the requests it concerned (they leave the batch); the server goes on.
fn fail(
    ids: &[u64],
    error: &InferError,
    live: &mut HashMap<u64, mpsc::UnboundedSender<Event>>,
    decoder: &mut dyn Decoder,
    metrics: &Metrics,
) {
    // Nothing else would show why requests failed: the HTTP layer answers the clients only.
    eprintln!("tandem serve: {} request(s) failed: {error}", ids.len());
    for id in ids {
        // The batch may already be unusable (the error came from it): failing the request is
        // what matters, a second error changes nothing.
        let _ = decoder.cancel(*id);
        if let Some(tx) = live.remove(id) {
            let _ = tx.send(Event::Failed {
                message: error.to_string(),
                invalid: matches!(error, InferError::Request { .. }),
            });
        }
        metrics.request_done(Outcome::Failed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;
    use tandem_infer::{AcceptanceStats, Finish};

    #[test]
    fn joins_wait_only_while_few_next_to_a_busy_batch() {
        // Off: never.
        assert!(!join_waits(0, 32, 1, 0));
        // 3 waiting next to 31 running: 24 < 31, held until the fourth round.
        assert!(join_waits(4, 31, 3, 0));
        assert!(join_waits(4, 31, 3, 3));
        assert!(!join_waits(4, 31, 3, 4));
        // A fourth request makes the join worth its prefill: 32 >= 31.
        assert!(!join_waits(4, 31, 4, 0));
        // A small batch never makes a request wait: 8 >= 8.
        assert!(!join_waits(4, 8, 1, 0));
        assert!(join_waits(4, 9, 1, 0));
        // Nothing waiting, nothing held; an idle batch admits at once.
        assert!(!join_waits(4, 32, 0, 0));
        assert!(!join_waits(4, 0, 1, 0));
    }

    /// A decoder whose request `id` emits token `id` once a step until `max_new_tokens`, and
    /// logs each admission's size.
    struct CountingDecoder {
        rows: Vec<(u64, usize, Vec<u32>)>,
        admissions: Arc<Mutex<Vec<usize>>>,
        /// The first admission waits for it (the test has queued every request): which
        /// requests join which admission must not depend on how fast the test submits them
        /// (once in ~20 runs the last 28 arrived after the batch had run rounds, and joined
        /// in one admission).
        gate: Option<std::sync::mpsc::Receiver<()>>,
    }

    impl CountingDecoder {
        fn emit(&mut self) -> Vec<Progress> {
            let mut progress = Vec::new();
            for (id, left, tokens) in &mut self.rows {
                tokens.push(*id as u32);
                *left -= 1;
                progress.push(Progress {
                    id: *id,
                    tokens: vec![*id as u32],
                    accepted: Some(0),
                    finished: (*left == 0).then(|| SpecOutput {
                        tokens: tokens.clone(),
                        finish: Finish::Length,
                        stats: AcceptanceStats::default(),
                        rounds_by_shape: Default::default(),
                    }),
                });
            }
            self.rows.retain(|(_, left, _)| *left > 0);
            progress
        }
    }

    impl Decoder for CountingDecoder {
        fn check(&self, _: &Request) -> Result<(), InferError> {
            Ok(())
        }
        fn admit(&mut self, requests: Vec<Request>) -> Result<Vec<Progress>, InferError> {
            if let Some(gate) = self.gate.take() {
                gate.recv().expect("the test opens the gate");
            }
            self.admissions.lock().unwrap().push(requests.len());
            // The admission's prefill gives each joining request (alone) its first token.
            let joining = requests
                .into_iter()
                .map(|r| (r.id, r.max_new_tokens, Vec::new()))
                .collect();
            let running = std::mem::replace(&mut self.rows, joining);
            let progress = self.emit();
            self.rows.extend(running);
            Ok(progress)
        }
        fn step(&mut self) -> Result<Vec<Progress>, InferError> {
            Ok(self.emit())
        }
        fn cancel(&mut self, id: u64) -> Result<Option<SpecOutput>, InferError> {
            self.rows.retain(|(row, ..)| *row != id);
            Ok(None)
        }
        fn running(&self) -> usize {
            self.rows.len()
        }
        fn limits(&self) -> Limits {
            Limits {
                context: 1024,
                max_prompt: 512,
                round: 1,
                draft_depth: 0,
            }
        }
    }

    /// 64 requests of ragged lengths through a batch of 32: the admission sizes, after every
    /// request got exactly its tokens.
    fn serve_ragged(join_hold_rounds: usize) -> Vec<usize> {
        let admissions = Arc::new(Mutex::new(Vec::new()));
        let log = admissions.clone();
        let (open, gate) = std::sync::mpsc::channel();
        let (scheduler, engine) = Scheduler::spawn(
            SchedulerConfig {
                max_batch: 32,
                max_queue: 64,
                join_hold_rounds,
            },
            Box::new(move || {
                Ok(Box::new(CountingDecoder {
                    rows: Vec::new(),
                    admissions: log,
                    gate: Some(gate),
                }) as Box<dyn Decoder>)
            }),
        )
        .unwrap();
        let length = |i: usize| 3 + (i * 7) % 13;
        let receivers: Vec<_> = (0..64)
            .map(|i| {
                let request = Request {
                    id: 0,
                    prompt: vec![1, 2, 3],
                    max_new_tokens: length(i),
                    stop_ids: Vec::new(),
                    sampling: Default::default(),
                    seed: 0,
                };
                scheduler.submit(request).unwrap()
            })
            .collect();
        open.send(()).unwrap();
        for (i, mut rx) in receivers.into_iter().enumerate() {
            let out = loop {
                match rx.blocking_recv().expect("the request ends with an event") {
                    Event::Finished(out) => break out,
                    Event::Tokens { .. } => {}
                    Event::Failed { message, .. } => panic!("request {i} failed: {message}"),
                }
            };
            assert_eq!(out.tokens.len(), length(i), "request {i}");
            assert!(
                out.tokens.iter().all(|&t| t == out.tokens[0]),
                "request {i}"
            );
        }
        drop(scheduler);
        engine.join().unwrap();
        let sizes = admissions.lock().unwrap().clone();
        assert_eq!(sizes.iter().sum::<usize>(), 64);
        sizes
    }

    #[test]
    fn held_joins_refill_a_ragged_batch_in_fewer_admissions_and_lose_no_request() {
        let at_once = serve_ragged(0);
        let held = serve_ragged(4);
        // Rows of 3..15 steps finish a few a round: at once they rejoin in small admissions
        // (here e.g. [20, 12, 2, 3, 3, 3, 2, 3, 3, 4, 5, 4] against [32, 6, 5, 5, 4, 4, 4, 4]).
        let small = |sizes: &[usize]| sizes.iter().filter(|&&n| n < 4).count();
        assert!(
            held.len() < at_once.len() && small(&held) < small(&at_once),
            "held {held:?}, at once {at_once:?}"
        );
    }
}
