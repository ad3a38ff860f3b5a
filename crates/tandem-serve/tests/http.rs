//! `tandem serve` over real HTTP on loopback, with the real SmolLM2 target and the committed
//! head on CPU: greedy output through the server equals target-only greedy output; bad inputs
//! get their 4xx with the field named; a full queue gets 429; a client that disconnects frees
//! its slot; /metrics and /v1/models answer.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use serde_json::{Value, json};
use tandem_infer::SpecConfig;
use tandem_infer::engine::target_greedy;
use tandem_infer::wiring::head_taps;
use tandem_model::backend::CpuBackend;
use tandem_model::{ChatMessage, TapRequest, TargetModel, TargetTokenizer};
use tandem_serve::scheduler::DecoderFactory;
use tandem_serve::{AppState, Decoder, Scheduler, SchedulerConfig, SpecDecoder};

type B = CpuBackend;
const MODEL: &str = "smollm2";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn model_dir() -> PathBuf {
    let dir = root().join("models/SmolLM2-135M-Instruct");
    assert!(
        dir.join("model.safetensors").exists(),
        "run scripts/fetch_smollm2.sh first ({} is missing)",
        dir.display()
    );
    dir
}

fn spec_factory(context: usize) -> DecoderFactory {
    Box::new(move || {
        let device = Default::default();
        let target = TargetModel::<B>::load(&model_dir(), &device).map_err(|e| e.to_string())?;
        let head = tandem_eagle::load_pretrained(
            &root().join("heads/smollm2-135m-eagle3"),
            target.embed_tokens.clone(),
            &device,
        )
        .map_err(|e| e.to_string())?;
        let taps = head_taps(
            &head.config,
            &target.spec.architecture,
            target.spec.num_layers,
        )
        .map_err(|e| e.to_string())?;
        let decoder = SpecDecoder::new(
            target,
            Some(head.draft),
            TapRequest::new(taps),
            SpecConfig::chain(3),
            context,
            None,
            0,
        )
        .map_err(|e| e.to_string())?;
        Ok(Box::new(decoder) as Box<dyn Decoder>)
    })
}

/// A server on a free loopback port, on its own runtime thread; returns its base URL.
fn start(config: SchedulerConfig, context: usize) -> String {
    let (scheduler, _engine) = Scheduler::spawn(config, spec_factory(context)).unwrap();
    let state = AppState {
        scheduler,
        tokenizer: Arc::new(TargetTokenizer::load(&model_dir()).unwrap()),
        model_id: MODEL.into(),
        default_max_tokens: 16,
    };
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            tx.send(listener.local_addr().unwrap()).unwrap();
            tandem_serve::serve(listener, tandem_serve::router(state))
                .await
                .unwrap();
        });
    });
    format!("http://{}", rx.recv().unwrap())
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

async fn post(client: &reqwest::Client, url: &str, body: &Value) -> (u16, Value) {
    let r = client.post(url).json(body).send().await.unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap_or(Value::Null))
}

fn chat(content: &str, max_tokens: usize) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": content}],
           "max_tokens": max_tokens, "temperature": 0})
}

#[test]
fn greedy_output_bad_inputs_and_metrics_over_http() {
    let url = start(
        SchedulerConfig {
            max_batch: 4,
            max_queue: 8,
            join_hold_rounds: 0,
        },
        256,
    );
    let rt = runtime();
    rt.block_on(async {
        let client = reqwest::Client::new();
        let questions = ["What is the capital of France?", "Name three primary colors."];
        // Two requests at once (they share the running batch).
        let endpoint = format!("{url}/v1/chat/completions");
        let (body_a, body_b) = (chat(questions[0], 12), chat(questions[1], 12));
        let (a, b) = tokio::join!(
            post(&client, &endpoint, &body_a),
            post(&client, &endpoint, &body_b),
        );
        let tokenizer = TargetTokenizer::load(&model_dir()).unwrap();
        let target = TargetModel::<B>::load(&model_dir(), &Default::default()).unwrap();
        for (question, (status, body)) in questions.iter().zip([a, b]) {
            assert_eq!(status, 200, "{body}");
            let prompt = tokenizer
                .encode_chat(&[ChatMessage::new("user", *question)], true)
                .unwrap();
            let expected = target_greedy(&target, &prompt, 12, &tokenizer.eos_ids).unwrap();
            let ids: Vec<u32> = serde_json::from_value(
                body["tandem"]["completion_token_ids"].clone(),
            )
            .unwrap();
            assert_eq!(ids, expected, "{question}");
            assert_eq!(
                body["choices"][0]["message"]["content"],
                json!(tokenizer.decode(&expected, false).unwrap())
            );
            assert_eq!(body["usage"]["completion_tokens"], json!(expected.len()));
            assert_eq!(body["usage"]["prompt_tokens"], json!(prompt.len()));
            assert!(body["tandem"]["rounds"].as_u64().unwrap() >= 1);
        }

        // A raw completion with a stop string: the text ends before it.
        let (status, body) = post(
            &client,
            &format!("{url}/v1/completions"),
            &json!({"model": MODEL, "prompt": "1, 2, 3, 4,", "max_tokens": 12,
                    "temperature": 0, "stop": [" 7"]}),
        )
        .await;
        assert_eq!(status, 200, "{body}");
        let text = body["choices"][0]["text"].as_str().unwrap();
        assert!(!text.contains(" 7"), "{text:?}");
        assert_eq!(body["choices"][0]["finish_reason"], "stop");

        // Bad inputs: status and the field named.
        let long = "word ".repeat(400);
        let cases: Vec<(&str, Value, u16, Value)> = vec![
            ("/v1/chat/completions", json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}), 404, json!("model")),
            ("/v1/chat/completions", json!({"model": MODEL, "messages": []}), 400, json!("messages")),
            ("/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}), 400, json!("messages[0].role")),
            ("/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": 3}), 400, json!("temperature")),
            ("/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_p": 0}), 400, json!("top_p")),
            ("/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}), 400, json!("max_tokens")),
            ("/v1/chat/completions", json!({"model": MODEL, "messages": [{"role": "user", "content": long}]}), 400, json!("messages")),
            ("/v1/completions", json!({"model": MODEL, "prompt": ""}), 400, json!("prompt")),
        ];
        for (path, body, status, param) in cases {
            let (got, reply) = post(&client, &format!("{url}{path}"), &body).await;
            assert_eq!(got, status, "{body} -> {reply}");
            assert_eq!(reply["error"]["param"], param, "{body} -> {reply}");
            assert!(reply["error"]["message"].as_str().is_some_and(|m| !m.is_empty()));
        }
        let r = client
            .post(format!("{url}/v1/chat/completions"))
            .body("{\"messages\": [")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 400);
        let r = client.get(format!("{url}/v1/nothing")).send().await.unwrap();
        assert_eq!(r.status().as_u16(), 404);
        // A type error names its field; a body over axum's 2 MB limit gets the JSON error too.
        let (got, reply) = post(
            &client,
            &format!("{url}/v1/chat/completions"),
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "8"}),
        )
        .await;
        assert_eq!((got, &reply["error"]["param"]), (400, &json!("max_tokens")), "{reply}");
        let big = json!({"model": MODEL, "messages": [{"role": "user", "content": "x ".repeat(1_500_000)}]});
        // Its own client: the server closes a connection whose body it did not read, and a
        // pooled connection would then fail the next request on the client side.
        let (got, reply) = post(&reqwest::Client::new(), &format!("{url}/v1/chat/completions"), &big).await;
        assert_eq!(got, 413, "{reply}");
        assert_eq!(reply["error"]["code"], "request_too_large", "{reply}");

        // The server is still healthy after all of that.
        let health: Value = client.get(format!("{url}/health")).send().await.unwrap().json().await.unwrap();
        assert_eq!(health["status"], "ok");
        let models: Value = client.get(format!("{url}/v1/models")).send().await.unwrap().json().await.unwrap();
        assert_eq!(models["data"][0]["id"], MODEL);
        let metrics = client.get(format!("{url}/metrics")).send().await.unwrap().text().await.unwrap();
        let count = |series: &str| -> f64 {
            metrics
                .lines()
                .find_map(|l| l.strip_prefix(series).and_then(|r| r.strip_prefix(' ')))
                .unwrap_or_else(|| panic!("{series} missing"))
                .parse()
                .unwrap()
        };
        assert_eq!(count("tandem_requests_total{outcome=\"ok\"}"), 3.0);
        assert_eq!(count("tandem_requests_total{outcome=\"invalid\"}"), 11.0);
        assert!(count("tandem_rounds_total") >= 3.0);
        assert!(metrics.contains("tandem_draft_position_acceptance{position=\"0\"}"));
    });
}

/// One sequence at a time and a queue of one: a third request is refused with 429; a streaming
/// client that disconnects frees the running slot at once, so the queued request completes.
#[test]
fn overload_gets_429_and_a_disconnect_frees_the_slot() {
    let url = start(
        SchedulerConfig {
            max_batch: 1,
            max_queue: 1,
            join_hold_rounds: 0,
        },
        512,
    );
    let rt = runtime();
    rt.block_on(async {
        let client = reqwest::Client::new();
        let endpoint = format!("{url}/v1/chat/completions");
        let mut long = chat("Write a long story about a dragon.", 400);
        long["stream"] = json!(true);
        let response = client.post(&endpoint).json(&long).send().await.unwrap();
        assert_eq!(response.status().as_u16(), 200);
        let mut stream = response.bytes_stream();
        // Wait for the first chunk: the long request is running.
        let first = stream.next().await.unwrap().unwrap();
        assert!(String::from_utf8_lossy(&first).starts_with("data: "));

        // The queue (one place) takes the next request; the one after is refused.
        let queued = tokio::spawn({
            let (client, endpoint) = (client.clone(), endpoint.clone());
            async move { post(&client, &endpoint, &chat("Say hi.", 4)).await }
        });
        let refused = loop {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let r = client
                .post(&endpoint)
                .json(&chat("Say hi.", 4))
                .send()
                .await
                .unwrap();
            if r.status().as_u16() == 429 {
                let retry = r
                    .headers()
                    .get("retry-after")
                    .map(|v| v.to_str().unwrap().to_owned());
                assert_eq!(retry.as_deref(), Some("1"), "429 without Retry-After");
                break r.json::<Value>().await.unwrap();
            }
            assert!(
                !queued.is_finished(),
                "the queued request ran before the slot was freed"
            );
        };
        assert_eq!(refused["error"]["code"], "queue_full");

        // Disconnect the long stream: its slot frees and the queued request finishes quickly,
        // long before 400 tokens could have been generated on CPU.
        let t0 = Instant::now();
        drop(stream);
        let (status, body) = queued.await.unwrap();
        assert_eq!(status, 200, "{body}");
        assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
        let metrics = client
            .get(format!("{url}/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        assert!(
            metrics.contains("tandem_requests_total{outcome=\"cancelled\"} 1"),
            "{metrics}"
        );
        assert!(
            metrics.contains("tandem_requests_total{outcome=\"rejected_queue_full\"} 1"),
            "{metrics}"
        );
    });
}

/// Sampling parameters and the seed pass through: two identical sampled requests decoded in
/// the same batch give the same output (each request has its own random stream).
#[test]
fn sampled_requests_are_reproducible_with_a_seed() {
    let url = start(
        SchedulerConfig {
            max_batch: 2,
            max_queue: 4,
            join_hold_rounds: 0,
        },
        256,
    );
    let rt = runtime();
    rt.block_on(async {
        let client = reqwest::Client::new();
        let mut body = chat("Tell me a fun fact.", 10);
        body["temperature"] = json!(0.8);
        body["top_p"] = json!(0.9);
        body["seed"] = json!(7);
        let endpoint = format!("{url}/v1/chat/completions");
        let (a, b) = tokio::join!(
            post(&client, &endpoint, &body),
            post(&client, &endpoint, &body)
        );
        assert_eq!(a.0, 200);
        assert_eq!(
            a.1["tandem"]["completion_token_ids"], b.1["tandem"]["completion_token_ids"],
            "same seed, same output, whatever the batch-mate"
        );
    });
}
