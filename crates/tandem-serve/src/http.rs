//! The axum routes: `POST /v1/completions`, `POST /v1/chat/completions` (plain and SSE
//! streaming), `GET /v1/models`, `GET /health`, `GET /metrics`; graceful shutdown on SIGTERM or
//! Ctrl-C (in-flight requests finish, new connections are refused).

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{OriginalUri, State};
use axum::http::{StatusCode, header};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tandem_infer::{Finish, Request, SpecOutput};
use tandem_model::TargetTokenizer;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::metrics::Outcome;
use crate::protocol::{
    ApiError, Endpoint, Generation, PromptSource, SpecUsage, Usage, chunk_body, parse_chat,
    parse_completion, response_body, usage_chunk_body,
};
use crate::scheduler::{Event, Scheduler, SubmitError};
use crate::text::TextStream;

/// Everything a handler needs.
#[derive(Clone)]
pub struct AppState {
    pub scheduler: Scheduler,
    pub tokenizer: Arc<TargetTokenizer>,
    /// The name clients pass as `model`.
    pub model_id: String,
    /// `max_tokens` when the client gives none (bounded by the context).
    pub default_max_tokens: usize,
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let mut response = (status, axum::Json(self.body())).into_response();
        if status == StatusCode::TOO_MANY_REQUESTS {
            // The queue drains in about a round; clients (and the openai SDK) honour this.
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        response
    }
}

/// A body axum refused before any handler saw it (over the body limit: 413; unreadable: 400),
/// as the same JSON error every other refusal gets instead of axum's plain-text reply.
fn rejected_body(rejection: BytesRejection) -> ApiError {
    ApiError::body_rejected(rejection.status().as_u16(), rejection.body_text())
}

/// The router over `state`.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(|OriginalUri(uri): OriginalUri| async move {
            ApiError::not_found(uri.path()).into_response()
        })
        .with_state(state)
}

/// Serves `router` on `listener` until SIGTERM or Ctrl-C, then drains in-flight requests.
pub async fn serve(listener: tokio::net::TcpListener, app: Router) -> std::io::Result<()> {
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = terminate => {},
    }
    eprintln!("tandem serve: shutting down, finishing in-flight requests");
}

async fn health() -> Response {
    axum::Json(json!({"status": "ok"})).into_response()
}

async fn models(State(s): State<AppState>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": s.model_id,
            "object": "model",
            "created": now(),
            "owned_by": "tandem",
            "max_model_len": s.scheduler.limits.context,
        }]
    }))
    .into_response()
}

async fn metrics(State(s): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.scheduler.metrics.render(),
    )
        .into_response()
}

async fn completions(State(s): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let parsed = body
        .map_err(rejected_body)
        .and_then(|body| parse_completion(&body, &s.model_id));
    generate(s, parsed, Endpoint::Completions).await
}

async fn chat_completions(
    State(s): State<AppState>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let parsed = body
        .map_err(rejected_body)
        .and_then(|body| parse_chat(&body, &s.model_id));
    generate(s, parsed, Endpoint::Chat).await
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Tokenises and bounds a validated request.
fn prepare(s: &AppState, g: &Generation) -> Result<Request, ApiError> {
    let (prompt, field) = match &g.prompt {
        PromptSource::Text(text) => (s.tokenizer.encode(text, true), "prompt"),
        PromptSource::Chat(messages) => (s.tokenizer.encode_chat(messages, true), "messages"),
    };
    let prompt = prompt.map_err(|e| ApiError::invalid(field.to_owned(), e.to_string()))?;
    let limits = s.scheduler.limits;
    if prompt.is_empty() {
        return Err(ApiError::invalid(
            field.to_owned(),
            "the prompt encodes to no tokens",
        ));
    }
    if prompt.len() > limits.max_prompt {
        return Err(ApiError::invalid(
            field.to_owned(),
            format!(
                "This model's maximum context length is {} tokens; the prompt has {} tokens \
                 (at most {} leave room to generate)",
                limits.context,
                prompt.len(),
                limits.max_prompt
            ),
        ));
    }
    let room = limits.context - prompt.len() - limits.round;
    let max_tokens = match g.max_tokens {
        None => s.default_max_tokens.min(room).max(1),
        Some(n) if n <= room => n,
        Some(n) => {
            return Err(ApiError::invalid(
                "max_tokens".to_owned(),
                format!(
                    "This model's maximum context length is {} tokens; the prompt has {} tokens \
                     and max_tokens asks for {n} more (at most {room})",
                    limits.context,
                    prompt.len()
                ),
            ));
        }
    };
    Ok(Request {
        id: 0,
        prompt,
        max_new_tokens: max_tokens,
        stop_ids: s.tokenizer.eos_ids.clone(),
        sampling: g.sampling,
        seed: g.seed.unwrap_or_else(rand::random),
    })
}

fn finish_reason(finish: Finish) -> &'static str {
    match finish {
        Finish::Stop => "stop",
        Finish::Length | Finish::ContextFull => "length",
    }
}

fn spec_usage(out: &SpecOutput, ids: &[u32]) -> SpecUsage {
    SpecUsage {
        accepted_draft_tokens: out.stats.accepted_tokens,
        rounds: out.stats.rounds,
        accept_length: out.stats.accept_length(),
        per_position_acceptance: out.stats.per_position(),
        shapes: out.rounds_by_shape.clone(),
        completion_token_ids: ids.to_vec(),
    }
}

async fn generate(
    s: AppState,
    parsed: Result<Generation, ApiError>,
    endpoint: Endpoint,
) -> Response {
    let metrics = s.scheduler.metrics.clone();
    let g = match parsed {
        Ok(g) => g,
        Err(e) => {
            metrics.request_done(Outcome::Invalid);
            return e.into_response();
        }
    };
    let request = match prepare(&s, &g) {
        Ok(r) => r,
        Err(e) => {
            metrics.request_done(Outcome::Invalid);
            return e.into_response();
        }
    };
    let prompt_tokens = request.prompt.len();
    let started = Instant::now();
    let events = match s.scheduler.submit(request) {
        Ok(rx) => rx,
        Err(SubmitError::QueueFull(n)) => {
            metrics.request_done(Outcome::Rejected);
            return ApiError::overloaded(n).into_response();
        }
        Err(SubmitError::ShuttingDown) => {
            return ApiError::unavailable("the server is shutting down").into_response();
        }
    };
    let ctx = RequestContext {
        id: format!(
            "{}-{:016x}",
            match endpoint {
                Endpoint::Completions => "cmpl",
                Endpoint::Chat => "chatcmpl",
            },
            rand::random::<u64>()
        ),
        created: now(),
        endpoint,
        prompt_tokens,
        started,
        state: s,
    };
    if g.stream {
        stream(ctx, events, g.stop, g.include_usage)
    } else {
        collect(ctx, events, g.stop).await
    }
}

struct RequestContext {
    id: String,
    created: u64,
    endpoint: Endpoint,
    prompt_tokens: usize,
    started: Instant,
    state: AppState,
}

impl RequestContext {
    fn decode(&self) -> impl Fn(&[u32]) -> String + '_ {
        |ids| self.state.tokenizer.decode(ids, false).unwrap_or_default()
    }
    fn usage(&self, completion: usize) -> Usage {
        Usage {
            prompt_tokens: self.prompt_tokens,
            completion_tokens: completion,
            total_tokens: self.prompt_tokens + completion,
        }
    }
}

/// Waits for the whole output. If the client goes away the handler is dropped, and with it
/// the event receiver, which cancels the request in the engine.
async fn collect(
    ctx: RequestContext,
    mut events: mpsc::UnboundedReceiver<Event>,
    stops: Vec<String>,
) -> Response {
    let metrics = ctx.state.scheduler.metrics.clone();
    let mut text = TextStream::new(stops);
    let mut out_text = String::new();
    let mut first = true;
    loop {
        match events.recv().await {
            Some(Event::Tokens { tokens, .. }) => {
                if first && !tokens.is_empty() {
                    metrics.first_token(ctx.started.elapsed().as_secs_f64());
                    first = false;
                }
                let d = text.push(&tokens, false, ctx.decode());
                out_text.push_str(&d.text);
                if d.stopped {
                    // Dropping the receiver below cancels the rest of the generation.
                    let ids = text.tokens().to_vec();
                    metrics.request_done(Outcome::Ok);
                    metrics.latency(ctx.started.elapsed().as_secs_f64());
                    let spec = SpecUsage {
                        completion_token_ids: ids.clone(),
                        ..SpecUsage::default()
                    };
                    return axum::Json(response_body(
                        ctx.endpoint,
                        &ctx.id,
                        ctx.created,
                        &ctx.state.model_id,
                        &out_text,
                        "stop",
                        &ctx.usage(ids.len()),
                        &spec,
                    ))
                    .into_response();
                }
            }
            Some(Event::Finished(out)) => {
                out_text.push_str(&text.push(&[], true, ctx.decode()).text);
                metrics.request_done(Outcome::Ok);
                metrics.latency(ctx.started.elapsed().as_secs_f64());
                let body = response_body(
                    ctx.endpoint,
                    &ctx.id,
                    ctx.created,
                    &ctx.state.model_id,
                    &out_text,
                    finish_reason(out.finish),
                    &ctx.usage(out.tokens.len()),
                    &spec_usage(&out, &out.tokens),
                );
                return axum::Json(body).into_response();
            }
            Some(Event::Failed { message, invalid }) => {
                return if invalid {
                    metrics.request_done(Outcome::Invalid);
                    ApiError::invalid(None, message).into_response()
                } else {
                    ApiError::internal(message).into_response()
                };
            }
            None => {
                return ApiError::internal("the engine stopped before the request finished")
                    .into_response();
            }
        }
    }
}

/// Streams chunks as server-sent events. A task turns engine events into SSE frames; when the
/// client disconnects, the response body (and the frame channel) is dropped, the task's next
/// send fails, it returns and drops the event receiver, which cancels the request.
fn stream(
    ctx: RequestContext,
    mut events: mpsc::UnboundedReceiver<Event>,
    stops: Vec<String>,
    include_usage: bool,
) -> Response {
    let (frames, rx) = mpsc::channel::<Result<SseEvent, std::convert::Infallible>>(64);
    tokio::spawn(async move {
        let metrics = ctx.state.scheduler.metrics.clone();
        let mut text = TextStream::new(stops);
        let mut first = true;
        let chunk = |delta: &str, first: bool, finish: Option<&str>| -> SseEvent {
            SseEvent::default().data(
                chunk_body(
                    ctx.endpoint,
                    &ctx.id,
                    ctx.created,
                    &ctx.state.model_id,
                    delta,
                    first,
                    finish,
                )
                .to_string(),
            )
        };
        let finish = |reason: &str, usage: Option<(Usage, SpecUsage)>| -> Vec<SseEvent> {
            let mut v = vec![chunk("", false, Some(reason))];
            if let Some((usage, spec)) = usage {
                v.push(
                    SseEvent::default().data(
                        usage_chunk_body(
                            ctx.endpoint,
                            &ctx.id,
                            ctx.created,
                            &ctx.state.model_id,
                            &usage,
                            &spec,
                        )
                        .to_string(),
                    ),
                );
            }
            v.push(SseEvent::default().data("[DONE]"));
            v
        };
        loop {
            let (frames_out, done): (Vec<SseEvent>, bool) = match events.recv().await {
                Some(Event::Tokens { tokens, .. }) => {
                    let d = text.push(&tokens, false, ctx.decode());
                    let mut v = Vec::new();
                    if !d.text.is_empty() || (first && ctx.endpoint == Endpoint::Chat) {
                        if first {
                            metrics.first_token(ctx.started.elapsed().as_secs_f64());
                        }
                        v.push(chunk(&d.text, first, None));
                        first = false;
                    }
                    if d.stopped {
                        let n = text.tokens().len();
                        let usage = include_usage.then(|| {
                            (
                                ctx.usage(n),
                                SpecUsage {
                                    completion_token_ids: text.tokens().to_vec(),
                                    ..SpecUsage::default()
                                },
                            )
                        });
                        v.extend(finish("stop", usage));
                        metrics.request_done(Outcome::Ok);
                        metrics.latency(ctx.started.elapsed().as_secs_f64());
                    }
                    (v, d.stopped)
                }
                Some(Event::Finished(out)) => {
                    let d = text.push(&[], true, ctx.decode());
                    let mut v = Vec::new();
                    if !d.text.is_empty() {
                        v.push(chunk(&d.text, first, None));
                    }
                    let usage = include_usage
                        .then(|| (ctx.usage(out.tokens.len()), spec_usage(&out, &out.tokens)));
                    v.extend(finish(finish_reason(out.finish), usage));
                    metrics.request_done(Outcome::Ok);
                    metrics.latency(ctx.started.elapsed().as_secs_f64());
                    (v, true)
                }
                Some(Event::Failed { message, .. }) => {
                    let err: Value = ApiError::internal(message).body();
                    (
                        vec![
                            SseEvent::default().data(err.to_string()),
                            SseEvent::default().data("[DONE]"),
                        ],
                        true,
                    )
                }
                None => (vec![SseEvent::default().data("[DONE]")], true),
            };
            for f in frames_out {
                if frames.send(Ok(f)).await.is_err() {
                    return; // the client went away: dropping `events` cancels the request
                }
            }
            if done {
                return;
            }
        }
    });
    Sse::new(ReceiverStream::new(rx))
        .keep_alive(KeepAlive::default())
        .into_response()
}
