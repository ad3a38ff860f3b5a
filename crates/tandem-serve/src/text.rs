//! Incremental detokenisation with stop strings, as the OpenAI API streams text: each call
//! returns the text that became final, holding back an incomplete UTF-8 character and any
//! suffix that could still grow into a stop string; a stop string ends the text before it.

/// The text of a growing token sequence.
#[derive(Debug, Clone, Default)]
pub struct TextStream {
    tokens: Vec<u32>,
    /// Bytes of the decoded text already handed out.
    sent: usize,
    stops: Vec<String>,
    stopped: bool,
}

/// What one push produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delta {
    /// Text that is now final.
    pub text: String,
    /// A stop string was found: the text ends before it and nothing follows.
    pub stopped: bool,
}

impl TextStream {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops,
            ..Self::default()
        }
    }

    /// All tokens pushed so far.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Adds `tokens`; `decode` turns the whole sequence into text. With `last`, everything
    /// still held back is released (the sequence has ended).
    pub fn push(&mut self, tokens: &[u32], last: bool, decode: impl Fn(&[u32]) -> String) -> Delta {
        if self.stopped {
            return Delta {
                text: String::new(),
                stopped: true,
            };
        }
        self.tokens.extend_from_slice(tokens);
        let text = decode(&self.tokens);
        // The earliest stop string that starts at or after what could still be unsent.
        let longest = self.stops.iter().map(String::len).max().unwrap_or(0);
        let search_from = floor_boundary(&text, self.sent.saturating_sub(longest));
        let found = self
            .stops
            .iter()
            .filter_map(|s| {
                text[search_from..]
                    .find(s.as_str())
                    .map(|i| search_from + i)
            })
            .min();
        if let Some(at) = found {
            let at = at.max(self.sent);
            let delta = text[self.sent..at].to_owned();
            self.sent = at;
            self.stopped = true;
            return Delta {
                text: delta,
                stopped: true,
            };
        }
        let mut end = text.len();
        if !last {
            // An incomplete character decodes as U+FFFD at the end: wait for the next token.
            if text.ends_with('\u{FFFD}') {
                end -= '\u{FFFD}'.len_utf8();
            }
            // Hold back a suffix that is a prefix of some stop string.
            let held = self
                .stops
                .iter()
                .map(|s| overlap(&text[..end], s))
                .max()
                .unwrap_or(0);
            end -= held;
        }
        let end = floor_boundary(&text, end.max(self.sent));
        let delta = text[self.sent..end].to_owned();
        self.sent = end;
        Delta {
            text: delta,
            stopped: false,
        }
    }
}

/// The longest suffix of `text` that is a proper prefix of `stop`.
fn overlap(text: &str, stop: &str) -> usize {
    (1..stop.len())
        .rev()
        .find(|&n| stop.is_char_boundary(n) && text.ends_with(&stop[..n]))
        .unwrap_or(0)
}

fn floor_boundary(text: &str, mut i: usize) -> usize {
    i = i.min(text.len());
    while !text.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Token i decodes to WORDS[i]; the sequence is their concatenation.
    const WORDS: [&str; 6] = ["Hel", "lo", " wor", "ld", "\n\n", "END"];

    fn decode(tokens: &[u32]) -> String {
        tokens.iter().map(|&t| WORDS[t as usize]).collect()
    }

    fn run(stops: &[&str], tokens: &[u32]) -> (Vec<String>, bool) {
        let mut s = TextStream::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = Vec::new();
        for (i, &t) in tokens.iter().enumerate() {
            let d = s.push(&[t], i + 1 == tokens.len(), decode);
            out.push(d.text);
            if d.stopped {
                return (out, true);
            }
        }
        (out, false)
    }

    #[test]
    fn without_stops_every_token_is_released() {
        let (out, stopped) = run(&[], &[0, 1, 2, 3]);
        assert_eq!(out, ["Hel", "lo", " wor", "ld"]);
        assert!(!stopped);
    }

    #[test]
    fn a_stop_string_across_tokens_ends_the_text_before_it() {
        // "Hello world": the stop "o w" spans tokens 1 and 2.
        let (out, stopped) = run(&["o w"], &[0, 1, 2, 3]);
        assert!(stopped);
        assert_eq!(out.concat(), "Hell");
        // "lo" ends with "o", a prefix of the stop: held back until " wor" decides.
        assert_eq!(out, ["Hel", "l", ""]);
    }

    #[test]
    fn a_held_back_prefix_is_released_when_it_does_not_grow_into_the_stop() {
        let (out, stopped) = run(&["o!"], &[0, 1, 2, 3]);
        assert!(!stopped);
        assert_eq!(out, ["Hel", "l", "o wor", "ld"]);
        assert_eq!(out.concat(), "Hello world");
    }

    #[test]
    fn the_earliest_of_several_stops_wins_and_nothing_follows() {
        let mut s = TextStream::new(vec!["END".into(), "\n".into()]);
        let d = s.push(&[0, 1, 4, 5], false, decode);
        assert_eq!(
            d,
            Delta {
                text: "Hello".into(),
                stopped: true
            }
        );
        let after = s.push(&[0], true, decode);
        assert_eq!(
            after,
            Delta {
                text: String::new(),
                stopped: true
            }
        );
    }

    #[test]
    fn an_incomplete_character_waits_for_the_next_token() {
        let mut s = TextStream::new(Vec::new());
        let bytes = "é".as_bytes().to_vec();
        let decode_bytes = |t: &[u32]| {
            let b: Vec<u8> = t.iter().map(|&x| bytes[x as usize]).collect();
            String::from_utf8_lossy(&b).into_owned()
        };
        assert_eq!(s.push(&[0], false, decode_bytes).text, "");
        assert_eq!(s.push(&[1], false, decode_bytes).text, "é");
    }
}
