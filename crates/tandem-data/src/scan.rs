//! Splits a top-level JSON array into the raw bytes of its elements without parsing them.
//!
//! Why a byte scanner rather than `serde_json`'s streaming deserializer: a serde sequence
//! visitor stops at the first error, but here one bad element (invalid UTF-8, a cut-off tail)
//! must cost that element only. Finding element boundaries needs just bracket depth and string
//! state (quotes, backslash escapes); each element is then decoded on its own. Memory stays at
//! one element plus the read buffer.

use std::io::{self, BufRead};

/// One array element, as raw bytes.
#[derive(Debug)]
pub(crate) struct Element {
    /// The element's bytes (a complete value, unless `complete` is false).
    pub bytes: Vec<u8>,
    /// Byte offset of the first byte in the stream.
    pub offset: u64,
    /// False when the stream ended inside this element (truncated file).
    pub complete: bool,
}

pub(crate) struct ArrayScanner<R> {
    inner: R,
    /// Bytes consumed so far.
    offset: u64,
    done: bool,
    /// The stream ended before the array's closing `]`.
    truncated: bool,
}

/// UTF-8 byte-order mark, tolerated at the start of a file.
pub(crate) const BOM: &[u8] = b"\xEF\xBB\xBF";

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

impl<R: BufRead> ArrayScanner<R> {
    /// Consumes the opening `[` (after an optional UTF-8 BOM and whitespace). `Ok(Err(why))`
    /// when the stream does not start a JSON array.
    pub(crate) fn new(mut inner: R) -> io::Result<Result<Self, String>> {
        let mut offset = 0u64;
        // Only the first buffer is checked for a BOM: a file's first read returns far more
        // than three bytes, so a BOM split across refills does not happen in practice.
        if inner.fill_buf()?.starts_with(BOM) {
            inner.consume(BOM.len());
            offset += BOM.len() as u64;
        }
        loop {
            let buf = inner.fill_buf()?;
            let Some(&first) = buf.first() else {
                return Ok(Err("file is empty".into()));
            };
            if is_ws(first) {
                let n = buf.iter().take_while(|&&b| is_ws(b)).count();
                inner.consume(n);
                offset += n as u64;
                continue;
            }
            if first != b'[' {
                return Ok(Err(format!(
                    "expected a JSON array, found byte {:?} at offset {offset}",
                    first as char
                )));
            }
            inner.consume(1);
            offset += 1;
            return Ok(Ok(ArrayScanner {
                inner,
                offset,
                done: false,
                truncated: false,
            }));
        }
    }

    pub(crate) fn truncated(&self) -> bool {
        self.truncated
    }

    /// Bytes consumed so far.
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// Skips whitespace and commas; returns the next significant byte without consuming it,
    /// or `None` at end of stream.
    fn skip_separators(&mut self) -> io::Result<Option<u8>> {
        loop {
            let buf = self.inner.fill_buf()?;
            if buf.is_empty() {
                return Ok(None);
            }
            // Commas are skipped like whitespace: a missing or doubled comma is not worth
            // failing neighbouring records over.
            match buf.iter().position(|&b| !is_ws(b) && b != b',') {
                Some(i) => {
                    let b = buf[i];
                    self.inner.consume(i);
                    self.offset += i as u64;
                    return Ok(Some(b));
                }
                None => {
                    let n = buf.len();
                    self.inner.consume(n);
                    self.offset += n as u64;
                }
            }
        }
    }

    /// The next element; `None` after the closing `]` or at end of stream.
    pub(crate) fn next_element(&mut self) -> Option<io::Result<Element>> {
        if self.done {
            return None;
        }
        let result = self.scan_element();
        if !matches!(result, Some(Ok(Element { complete: true, .. }))) {
            self.done = true;
        }
        result
    }

    fn scan_element(&mut self) -> Option<io::Result<Element>> {
        match self.skip_separators() {
            Err(e) => return Some(Err(e)),
            Ok(None) => {
                self.truncated = true;
                return None;
            }
            Ok(Some(b']')) => {
                self.inner.consume(1);
                self.offset += 1;
                return None;
            }
            Ok(Some(_)) => {}
        }
        let offset = self.offset;
        let mut out = Vec::new();
        let mut depth: u32 = 0;
        let mut in_string = false;
        let mut escaped = false;
        loop {
            let buf = match self.inner.fill_buf() {
                Ok(b) => b,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Some(Err(e)),
            };
            if buf.is_empty() {
                self.truncated = true;
                return Some(Ok(Element {
                    bytes: out,
                    offset,
                    complete: false,
                }));
            }
            // `end`: (bytes to consume, bytes belonging to the element).
            let mut end = None;
            let mut i = 0;
            while i < buf.len() {
                if in_string {
                    if escaped {
                        escaped = false;
                        i += 1;
                        continue;
                    }
                    // Strings are most of the data: jump to the next quote or backslash.
                    match memchr::memchr2(b'"', b'\\', &buf[i..]) {
                        None => i = buf.len(),
                        Some(k) => {
                            i += k;
                            if buf[i] == b'\\' {
                                escaped = true;
                            } else {
                                in_string = false;
                                if depth == 0 {
                                    end = Some((i + 1, i + 1));
                                    break;
                                }
                            }
                            i += 1;
                        }
                    }
                    continue;
                }
                match buf[i] {
                    b'"' => in_string = true,
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' if depth > 0 => {
                        depth -= 1;
                        if depth == 0 {
                            end = Some((i + 1, i + 1));
                            break;
                        }
                    }
                    // A scalar element ends at a delimiter, which stays for the next call.
                    b',' | b']' if depth == 0 => {
                        end = Some((i, i));
                        break;
                    }
                    b if depth == 0 && is_ws(b) => {
                        end = Some((i, i));
                        break;
                    }
                    _ => {}
                }
                i += 1;
            }
            match end {
                Some((consume, keep)) => {
                    out.extend_from_slice(&buf[..keep]);
                    self.inner.consume(consume);
                    self.offset += consume as u64;
                    return Some(Ok(Element {
                        bytes: out,
                        offset,
                        complete: true,
                    }));
                }
                None => {
                    let n = buf.len();
                    out.extend_from_slice(buf);
                    self.inner.consume(n);
                    self.offset += n as u64;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::BufReader;

    /// Scans `input` through a reader with a tiny buffer, so boundaries fall everywhere.
    fn scan(input: &[u8], cap: usize) -> (Vec<(String, bool)>, bool) {
        let mut s = ArrayScanner::new(BufReader::with_capacity(cap, input))
            .unwrap()
            .unwrap();
        let mut out = Vec::new();
        while let Some(e) = s.next_element() {
            let e = e.unwrap();
            out.push((String::from_utf8_lossy(&e.bytes).into_owned(), e.complete));
        }
        (out, s.truncated())
    }

    #[test]
    fn splits_elements_respecting_strings_and_escapes() {
        let input = br#" [ {"a": "x]}\"{,"}, {"b": [1, {"c": "\\"}]} ,"s,]" , 12 , null,[],{}]  "#;
        for cap in [1, 2, 3, 7, 64, 4096] {
            let (els, truncated) = scan(input, cap);
            let texts: Vec<_> = els.iter().map(|(t, _)| t.as_str()).collect();
            assert_eq!(
                texts,
                [
                    r#"{"a": "x]}\"{,"}"#,
                    r#"{"b": [1, {"c": "\\"}]}"#,
                    r#""s,]""#,
                    "12",
                    "null",
                    "[]",
                    "{}"
                ],
                "buffer {cap}"
            );
            assert!(els.iter().all(|(_, c)| *c));
            assert!(!truncated);
        }
    }

    #[test]
    fn truncated_tail_is_one_incomplete_element() {
        for cap in [1, 5, 4096] {
            let (els, truncated) = scan(b"[{\"a\": 1}, {\"b\": \"cut \\\" he", cap);
            assert_eq!(els.len(), 2);
            assert!(els[0].1);
            assert_eq!(els[1], ("{\"b\": \"cut \\\" he".into(), false));
            assert!(truncated);
        }
        // Cut between elements: nothing partial, but the missing `]` is noticed.
        let (els, truncated) = scan(b"[{\"a\": 1},\n ", 4096);
        assert_eq!(els.len(), 1);
        assert!(truncated);
    }

    #[test]
    fn bom_empty_and_non_arrays() {
        let (els, truncated) = scan(b"\xEF\xBB\xBF[]", 4096);
        assert!(els.is_empty() && !truncated);
        let err = |b: &[u8]| ArrayScanner::new(b).unwrap().err().unwrap();
        assert!(err(b"").contains("empty"));
        assert!(err(b"  \n").contains("empty"));
        assert!(err(b"{\"a\":1}").contains("expected a JSON array"));
    }

    #[test]
    fn offsets_point_at_elements() {
        let input = b"[ {\"a\":1},\n  {\"b\":2}]";
        let mut s = ArrayScanner::new(&input[..]).unwrap().unwrap();
        let a = s.next_element().unwrap().unwrap();
        let b = s.next_element().unwrap().unwrap();
        assert_eq!(&input[a.offset as usize..][..a.bytes.len()], &a.bytes[..]);
        assert_eq!(&input[b.offset as usize..][..b.bytes.len()], &b.bytes[..]);
        assert!(s.next_element().is_none());
        assert!(s.next_element().is_none());
    }
}
