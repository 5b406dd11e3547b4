//! ONNX protobuf handling before tract sees a graph: decoding bytes, resolving external data
//! from bytes (a browser has no file system), and fixing graph inputs to constants.

use std::collections::HashMap;

use tract_onnx::pb;
use tract_onnx::prelude::{DatumType, Tensor};

use crate::error::{Error, Result};

/// `TensorProto.DataLocation.EXTERNAL`.
const EXTERNAL: i32 = 1;

/// Decode an ONNX file and resolve its external data (`model.onnx.data`) from `external`.
pub fn decode(bytes: &[u8], external: Option<&[u8]>, file_name: &str) -> Result<pb::ModelProto> {
    let decoded = Decoded {
        proto: decode_bare(bytes, file_name)?,
        apart: Apart::new(),
    };
    Ok(prepare(decoded, external, file_name)?.proto)
}

/// Decode an ONNX file's protobuf, every initializer's data in it.
pub fn decode_bare(bytes: &[u8], file_name: &str) -> Result<pb::ModelProto> {
    let mut decoder = StreamDecoder::new(file_name);
    decoder.feed(bytes)?;
    Ok(decoder.finish()?.proto)
}

/// The data of large initializers kept apart from the protobuf, by name: tract tensors of
/// bytes (`u8`, one axis, aligned for any type) that become the weights' tensors in place
/// (`into_typed`).
pub type Apart = HashMap<String, Tensor>;

/// A decoded ONNX file: the protobuf, and the data of the initializers in `apart` (their
/// `TensorProto`s keep name, type and shape, and no data).
#[derive(Debug, Clone)]
pub struct Decoded {
    pub proto: pb::ModelProto,
    pub apart: Apart,
}

/// The tract type of an ONNX data type, when it is a number (every bit pattern a value).
pub(crate) fn number_type(data_type: i32) -> Option<DatumType> {
    pb::tensor_proto::DataType::try_from(data_type)
        .ok()
        .and_then(|d| d.try_into().ok())
        .filter(|dt: &DatumType| dt.is_number())
}

/// Whether initializers of this ONNX data type can become tensors in place (`into_typed`).
pub fn is_number(data_type: i32) -> bool {
    number_type(data_type).is_some()
}

/// The byte tensor `bytes` of initializer `t` as the tensor `t` describes (its type and shape),
/// in place; `t` must be of a number type (`is_number`).
pub fn into_typed(t: &pb::TensorProto, mut bytes: Tensor) -> Result<Tensor> {
    let bad = |why: String| Error::Model(format!("initializer `{}`: {why}", t.name));
    let dt = number_type(t.data_type)
        .ok_or_else(|| bad(format!("data type {} cannot be kept apart", t.data_type)))?;
    let shape = t
        .dims
        .iter()
        .map(|&d| usize::try_from(d).map_err(|_| bad(format!("negative dimension {d}"))))
        .collect::<Result<Vec<usize>>>()?;
    let size = shape
        .iter()
        .try_fold(dt.size_of(), |a, &d| a.checked_mul(d));
    if size != Some(bytes.len()) {
        return Err(bad(format!(
            "{} bytes of data for dims {:?} of {dt:?}",
            bytes.len(),
            t.dims
        )));
    }
    // SAFETY: a plain byte buffer aligned for any type (`apart_buffer`), as long as the shape
    // says and of a numeric type, every bit pattern of which is a value.
    unsafe {
        bytes.set_datum_type(dt);
        bytes.set_shape_unchecked(&shape);
    }
    Ok(bytes)
}

/// An uninitialized byte tensor of `len` bytes, aligned like tract's own tensors; `None` when
/// the memory cannot be had.
fn apart_buffer(len: usize) -> Option<Tensor> {
    // A failed allocation inside tract would abort: ask for the memory first.
    let mut probe: Vec<u8> = Vec::new();
    probe.try_reserve_exact(len).ok()?;
    drop(probe);
    // SAFETY: every byte is written by the decoder before the tensor is read (a file that
    // ends first is an error, and the tensor is dropped).
    unsafe {
        Tensor::uninitialized_aligned_dt(
            DatumType::U8,
            &[len],
            tract_onnx::tract_core::internal::vector_size().max(16),
        )
        .ok()
    }
}

/// What follows the decoding of an ONNX file: external data, checks (`wellformed`), repeated
/// nodes merged, the weight rewrites.
pub fn prepare(decoded: Decoded, external: Option<&[u8]>, file_name: &str) -> Result<Decoded> {
    let Decoded {
        mut proto,
        mut apart,
    } = decoded;
    let graph = proto
        .graph
        .as_mut()
        .ok_or_else(|| Error::Model(format!("{file_name} contains no graph")))?;
    if graph.node.is_empty() {
        return Err(Error::Model(format!("{file_name} contains an empty graph")));
    }
    inline_external_data(graph, external, file_name)?;
    super::wellformed::check(graph, file_name)?;
    super::cse::merge_common(graph);
    super::ops::matmul_integer::fuse_scales_in_graph(graph);
    super::weights::rewrite(&mut proto, &mut apart)?;
    Ok(Decoded { proto, apart })
}

/// Decodes an ONNX file as its bytes arrive (`feed`, chunk by chunk), so that the whole file
/// is never held: the `raw_data` of the graph's large initializers is copied straight into
/// its own buffer (the tensor's, once decoded), and the rest of the protobuf (nodes, small
/// initializers, inputs) is collected and decoded with `prost` when its message ends. Decoding
/// from the whole file's bytes (prost alone) would hold the bytes and the decoded weights at
/// once.
pub struct StreamDecoder {
    file_name: String,
    /// Bytes consumed so far.
    pos: u64,
    /// The start of a field header cut by the end of a chunk.
    carry: Vec<u8>,
    /// The messages open at `pos`: the model, then maybe its graph, then maybe a large
    /// initializer of the graph.
    levels: Vec<Level>,
    /// The field whose payload is being copied: into the innermost level's `raw` (true) or
    /// `rest`, and how many bytes remain.
    copying: Option<(bool, u64)>,
    /// Initializers of at least this many bytes are decoded apart.
    large: u64,
    /// Their data, when kept apart from the protobuf (`new_apart`).
    apart: Option<Apart>,
    /// What was wrong with the file, once something was.
    failed: Option<String>,
}

#[derive(PartialEq)]
enum Kind {
    Model,
    Graph,
    Tensor,
}

struct Level {
    kind: Kind,
    /// Where the message ends (the model: at the end of the file).
    end: Option<u64>,
    /// The message's other fields, as they were in the file.
    rest: Vec<u8>,
    /// Graph: its large initializers, decoded. Tensor: its `raw_data`.
    tensors: Vec<pb::TensorProto>,
    raw: Option<Raw>,
    /// Model: its graph, decoded.
    graph: Option<pb::GraphProto>,
}

impl Level {
    fn new(kind: Kind, end: Option<u64>) -> Level {
        Level {
            kind,
            end,
            rest: Vec::new(),
            tensors: Vec::new(),
            raw: None,
            graph: None,
        }
    }
}

/// Where a large initializer's `raw_data` goes: its own buffer, or a tensor kept apart (with
/// how much of it is filled).
enum Raw {
    Bytes(Vec<u8>),
    Apart(Tensor, usize),
}

/// `ModelProto.graph`, `GraphProto.initializer`, `TensorProto.raw_data`.
const MODEL_GRAPH: u64 = 7;
const GRAPH_INITIALIZER: u64 = 5;
const TENSOR_RAW_DATA: u64 = 9;
/// The longest field header: a tag and a length, ten bytes each at most.
const MAX_HEADER: usize = 20;

/// A field's header: its number, wire type, the payload length that follows it, and the
/// header's length in bytes.
struct Header {
    field: u64,
    wire_type: u8,
    payload: u64,
    len: usize,
}

/// A varint at the start of `b` and its length; `None` when `b` ends inside it.
fn varint(b: &[u8]) -> std::result::Result<Option<(u64, usize)>, &'static str> {
    let mut v = 0u64;
    for (i, &byte) in b.iter().enumerate().take(10) {
        v |= ((byte & 0x7f) as u64) << (7 * i);
        if byte < 0x80 {
            return Ok(Some((v, i + 1)));
        }
    }
    if b.len() >= 10 {
        Err("a varint longer than ten bytes")
    } else {
        Ok(None)
    }
}

fn header(b: &[u8]) -> std::result::Result<Option<Header>, &'static str> {
    let Some((tag, a)) = varint(b)? else {
        return Ok(None);
    };
    let (field, wire_type) = (tag >> 3, (tag & 7) as u8);
    if field == 0 {
        return Err("a field numbered 0");
    }
    let (payload, len) = match wire_type {
        // A varint value: kept in the header.
        0 => match varint(&b[a..])? {
            Some((_, n)) => (0, a + n),
            None => return Ok(None),
        },
        1 => (8, a),
        2 => match varint(&b[a..])? {
            Some((l, n)) => (l, a + n),
            None => return Ok(None),
        },
        5 => (4, a),
        _ => return Err("an unsupported wire type (groups)"),
    };
    Ok(Some(Header {
        field,
        wire_type,
        payload,
        len,
    }))
}

/// The decoder's levels always hold the model's (`feed` never closes it, `finish` takes it): an
/// error rather than a panic if that ever stops being true.
fn level_gone() -> String {
    "the decoder lost track of the message it is in".to_string()
}

impl StreamDecoder {
    pub fn new(file_name: &str) -> StreamDecoder {
        StreamDecoder {
            file_name: file_name.to_owned(),
            pos: 0,
            carry: Vec::new(),
            levels: vec![Level::new(Kind::Model, None)],
            copying: None,
            large: super::ops::LARGE_INITIALIZER as u64,
            apart: None,
            failed: None,
        }
    }

    /// A decoder that keeps the large initializers' data apart from the protobuf, each in the
    /// buffer that becomes its tensor (`Decoded::apart`): nothing is copied after the read.
    pub fn new_apart(file_name: &str) -> StreamDecoder {
        StreamDecoder {
            apart: Some(Apart::new()),
            ..StreamDecoder::new(file_name)
        }
    }

    /// What is wrong at the current position.
    fn invalid(&self, what: impl std::fmt::Display) -> String {
        format!("{what} (at byte {})", self.pos)
    }

    fn error(&self, why: &str) -> Error {
        Error::Model(format!(
            "{} is not a valid ONNX file: {why}",
            self.file_name
        ))
    }

    /// The file's name in messages (a streamed file's is known once its reading started).
    pub fn set_file_name(&mut self, file_name: &str) {
        self.file_name = file_name.to_owned();
    }

    /// The next bytes of the file. After an error every call returns it again, and so does
    /// `finish`.
    pub fn feed(&mut self, data: &[u8]) -> Result<()> {
        if self.failed.is_none() {
            self.failed = self.feed_inner(data).err();
        }
        match &self.failed {
            Some(why) => Err(self.error(why)),
            None => Ok(()),
        }
    }

    /// Initializers of at least `bytes` bytes are decoded apart (tests: the fixtures' are small).
    #[cfg(test)]
    pub(crate) fn with_large(mut self, bytes: u64) -> StreamDecoder {
        self.large = bytes;
        self
    }

    fn feed_inner(&mut self, mut data: &[u8]) -> std::result::Result<(), String> {
        loop {
            if let Some((raw, left)) = self.copying {
                let n = left.min(data.len() as u64) as usize;
                let level = self.levels.last_mut().ok_or_else(level_gone)?;
                match (raw, level.raw.as_mut()) {
                    (true, Some(Raw::Bytes(r))) => r.extend_from_slice(&data[..n]),
                    (true, Some(Raw::Apart(t, filled))) => {
                        t.as_bytes_mut()[*filled..*filled + n].copy_from_slice(&data[..n]);
                        *filled += n;
                    }
                    _ => level.rest.extend_from_slice(&data[..n]),
                }
                data = &data[n..];
                self.pos += n as u64;
                if left > n as u64 {
                    self.copying = Some((raw, left - n as u64));
                    return Ok(());
                }
                self.copying = None;
            }
            while self.levels.last().and_then(|l| l.end) == Some(self.pos) {
                self.close()?;
            }
            if data.is_empty() {
                return Ok(());
            }
            // A field header, maybe begun in the previous chunk.
            let mut buf = [0u8; MAX_HEADER];
            let carried = self.carry.len();
            let taken = (MAX_HEADER - carried).min(data.len());
            buf[..carried].copy_from_slice(&self.carry);
            buf[carried..carried + taken].copy_from_slice(&data[..taken]);
            let Some(h) = header(&buf[..carried + taken]).map_err(|e| self.invalid(e))? else {
                self.carry.extend_from_slice(&data[..taken]);
                return Ok(());
            };
            self.carry.clear();
            data = &data[h.len - carried..];
            self.pos += h.len as u64;
            let end = self.pos.checked_add(h.payload);
            let level = self.levels.last_mut().ok_or_else(level_gone)?;
            if end.is_none() || level.end.is_some_and(|e| end > Some(e)) {
                return Err(self.invalid("a field runs past the end of its message"));
            }
            let length_delimited = h.wire_type == 2;
            match (&level.kind, h.field) {
                (Kind::Model, MODEL_GRAPH) if length_delimited => {
                    self.levels.push(Level::new(Kind::Graph, end));
                }
                (Kind::Graph, GRAPH_INITIALIZER) if length_delimited && h.payload >= self.large => {
                    self.levels.push(Level::new(Kind::Tensor, end));
                }
                (Kind::Tensor, TENSOR_RAW_DATA) if length_delimited => {
                    let len = h.payload as usize;
                    let raw = if self.apart.is_some() {
                        apart_buffer(len).map(|t| Raw::Apart(t, 0))
                    } else {
                        let mut raw = Vec::new();
                        raw.try_reserve_exact(len).ok().map(|_| Raw::Bytes(raw))
                    };
                    let Some(raw) = raw else {
                        return Err(
                            self.invalid(format!("a tensor of {len} bytes does not fit in memory"))
                        );
                    };
                    level.raw = Some(raw);
                    self.copying = Some((true, h.payload));
                }
                _ => {
                    level.rest.extend_from_slice(&buf[..h.len]);
                    self.copying = Some((false, h.payload));
                }
            }
        }
    }

    /// The innermost message ended: decode it into its parent.
    fn close(&mut self) -> std::result::Result<(), String> {
        let level = self.levels.pop().ok_or_else(level_gone)?;
        let parent = self.levels.last_mut().ok_or_else(level_gone)?;
        let bad = |e: prost::DecodeError| e.to_string();
        match level.kind {
            Kind::Tensor => {
                let mut t = match <pb::TensorProto as prost::Message>::decode(&level.rest[..]) {
                    Ok(t) => t,
                    Err(e) => return Err(self.invalid(bad(e))),
                };
                match level.raw {
                    Some(Raw::Bytes(raw)) => t.raw_data = raw,
                    Some(Raw::Apart(tensor, _)) => {
                        let apart = self
                            .apart
                            .as_mut()
                            .ok_or("a tensor kept apart without apart buffers")?;
                        if apart.insert(t.name.clone(), tensor).is_some() {
                            return Err(self.invalid(format!("two initializers `{}`", t.name)));
                        }
                    }
                    None => {}
                }
                parent.tensors.push(t);
            }
            Kind::Graph => match <pb::GraphProto as prost::Message>::decode(&level.rest[..]) {
                Ok(mut g) if parent.graph.is_none() => {
                    g.initializer.extend(level.tensors);
                    parent.graph = Some(g);
                }
                Ok(_) => return Err(self.invalid("two graphs")),
                Err(e) => return Err(self.invalid(bad(e))),
            },
            // The model is the outermost level, which `finish` closes: never a parent's child.
            Kind::Model => return Err("the model message inside another message".into()),
        }
        Ok(())
    }

    /// The whole file was fed: the decoded protobuf (and the data kept apart).
    pub fn finish(mut self) -> Result<Decoded> {
        if let Some(why) = &self.failed {
            return Err(self.error(why));
        }
        if self.pos == 0 && self.carry.is_empty() {
            return Err(Error::Model(format!("{} is empty", self.file_name)));
        }
        if !self.carry.is_empty() || self.copying.is_some() || self.levels.len() != 1 {
            return Err(self.error(&self.invalid("the file ends inside a field (truncated?)")));
        }
        let model = self.levels.pop().ok_or_else(|| self.error(&level_gone()))?;
        let mut proto = <pb::ModelProto as prost::Message>::decode(&model.rest[..])
            .map_err(|e| self.error(&self.invalid(e)))?;
        proto.graph = model.graph;
        Ok(Decoded {
            proto,
            apart: self.apart.take().unwrap_or_default(),
        })
    }
}

fn inline_external_data(
    graph: &mut pb::GraphProto,
    external: Option<&[u8]>,
    file_name: &str,
) -> Result<()> {
    for tensor in graph.initializer.iter_mut() {
        inline_tensor(tensor, external, file_name)?;
    }
    for node in graph.node.iter_mut() {
        for attr in node.attribute.iter_mut() {
            if let Some(t) = attr.t.as_mut() {
                inline_tensor(t, external, file_name)?;
            }
            if let Some(g) = attr.g.as_mut() {
                inline_external_data(g, external, file_name)?;
            }
        }
    }
    Ok(())
}

fn inline_tensor(t: &mut pb::TensorProto, external: Option<&[u8]>, file_name: &str) -> Result<()> {
    if t.data_location != Some(EXTERNAL) {
        return Ok(());
    }
    let entry = |key: &str| {
        t.external_data
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.value.clone())
    };
    let location = entry("location").unwrap_or_default();
    let data = external.ok_or_else(|| {
        Error::Model(format!(
            "{file_name} keeps its weights in the external data file `{location}`, which was not given"
        ))
    })?;
    let parse = |key: &str| -> Result<Option<usize>> {
        entry(key)
            .map(|v| {
                v.parse::<usize>().map_err(|_| {
                    Error::Model(format!(
                        "tensor `{}`: bad external data {key} {v:?}",
                        t.name
                    ))
                })
            })
            .transpose()
    };
    let offset = parse("offset")?.unwrap_or(0);
    let length = match parse("length")? {
        Some(l) => l,
        None => data.len().saturating_sub(offset),
    };
    let end = offset
        .checked_add(length)
        .filter(|&e| e <= data.len())
        .ok_or_else(|| {
            Error::Model(format!(
                "tensor `{}` lies at bytes {offset}..{} of `{location}`, which has only {} bytes \
             (truncated or wrong external data file?)",
                t.name,
                offset.saturating_add(length),
                data.len()
            ))
        })?;
    t.raw_data = data[offset..end].to_vec();
    t.data_location = None;
    t.external_data.clear();
    Ok(())
}

/// Specialise a graph for a known value of the boolean input `name` (a merged decoder's
/// `use_cache_branch`): every `If` on it is replaced by the nodes of the branch taken, and the
/// input is removed. The step then never runs an `If`, and each branch compiles on its own.
pub fn specialize_bool_input(proto: &mut pb::ModelProto, name: &str, value: bool) -> Result<()> {
    let graph = proto
        .graph
        .as_mut()
        .ok_or_else(|| Error::Model("the ONNX file contains no graph".into()))?;
    let before = graph.input.len();
    graph.input.retain(|i| i.name != name);
    if graph.input.len() == before {
        return Err(Error::Model(format!("the graph has no input `{name}`")));
    }
    let branch_name = if value { "then_branch" } else { "else_branch" };
    let mut nodes = Vec::with_capacity(graph.node.len());
    for node in std::mem::take(&mut graph.node) {
        if node.op_type != "If" || node.input.first().map(String::as_str) != Some(name) {
            nodes.push(node);
            continue;
        }
        let branch = node
            .attribute
            .iter()
            .find(|a| a.name == branch_name)
            .and_then(|a| a.g.clone())
            .ok_or_else(|| {
                Error::Model(format!("`If` node `{}` has no {branch_name}", node.name))
            })?;
        graph.initializer.extend(branch.initializer);
        // Node names are scoped to their graph (and exporters repeat them): number them so
        // they stay unique once inlined.
        nodes.extend(branch.node.into_iter().enumerate().map(|(i, mut n)| {
            n.name = format!("{}/{i}/{}", node.name, n.name);
            n
        }));
        for (inner, outer) in branch.output.iter().zip(&node.output) {
            if &inner.name != outer {
                nodes.push(pb::NodeProto {
                    op_type: "Identity".into(),
                    name: format!("{}/{}", node.name, outer),
                    input: vec![inner.name.clone()],
                    output: vec![outer.clone()],
                    ..Default::default()
                });
            }
        }
    }
    graph.node = nodes;
    // Anything else that reads the input sees the constant.
    if graph.node.iter().any(|n| n.input.iter().any(|i| i == name)) {
        graph.initializer.push(pb::TensorProto {
            name: name.to_owned(),
            dims: vec![1],
            data_type: pb::tensor_proto::DataType::Bool as i32,
            raw_data: vec![value as u8],
            ..Default::default()
        });
    }
    Ok(())
}

/// Drop the nodes whose outputs nothing reads: no graph output, no node that is kept, no node
/// of a subgraph of one (a branch may read an outer value by its name).
pub(crate) fn drop_unread_nodes(graph: &mut pb::GraphProto) {
    let producer: HashMap<&str, usize> = (graph.node.iter().enumerate())
        .flat_map(|(ix, n)| n.output.iter().map(move |o| (o.as_str(), ix)))
        .filter(|(o, _)| !o.is_empty())
        .collect();
    let mut kept = vec![false; graph.node.len()];
    let mut wanted: Vec<&str> = graph.output.iter().map(|o| o.name.as_str()).collect();
    while let Some(name) = wanted.pop() {
        let Some(&ix) = producer.get(name) else {
            continue;
        };
        if std::mem::replace(&mut kept[ix], true) {
            continue;
        }
        let node = &graph.node[ix];
        wanted.extend(node.input.iter().map(String::as_str));
        for g in subgraphs(node) {
            names_read(g, &mut wanted);
        }
    }
    let nodes = std::mem::take(&mut graph.node).into_iter().zip(kept);
    graph.node = nodes.filter_map(|(n, kept)| kept.then_some(n)).collect();
}

/// Every name the nodes of `graph` and of its subgraphs read, and its outputs.
fn names_read<'a>(graph: &'a pb::GraphProto, into: &mut Vec<&'a str>) {
    into.extend(graph.output.iter().map(|o| o.name.as_str()));
    for node in &graph.node {
        into.extend(node.input.iter().map(String::as_str));
        for g in subgraphs(node) {
            names_read(g, into);
        }
    }
}

/// The subgraphs of a node's attributes (`If` branches, `Loop` and `Scan` bodies).
pub(crate) fn subgraphs(node: &pb::NodeProto) -> impl Iterator<Item = &pb::GraphProto> {
    node.attribute
        .iter()
        .flat_map(|a| a.g.iter().chain(&a.graphs))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> Vec<u8> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/models")
            .join(name);
        std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    fn sorted(mut p: pb::ModelProto) -> pb::ModelProto {
        if let Some(g) = p.graph.as_mut() {
            g.initializer.sort_by(|a, b| a.name.cmp(&b.name));
        }
        p
    }

    /// Fed in chunks of any size (1 byte: every header cut), with initializers decoded apart
    /// from 1 KiB, the stream decoder gives prost's protobuf (initializers in another order).
    #[test]
    fn stream_decoding_is_prost_decoding() {
        for name in ["gpt2/model.onnx", "gpt2-merged/decoder_model_merged.onnx"] {
            let bytes = fixture(name);
            let expected = sorted(<pb::ModelProto as prost::Message>::decode(&bytes[..]).unwrap());
            let apart = expected
                .graph
                .as_ref()
                .unwrap()
                .initializer
                .iter()
                .filter(|t| t.raw_data.len() >= 1024)
                .count();
            assert!(apart > 3, "{name}: {apart} large initializers");
            for chunk in [1, 7, 4096, bytes.len()] {
                let mut d = StreamDecoder::new(name);
                d.large = 1024;
                for c in bytes.chunks(chunk) {
                    d.feed(c).unwrap();
                }
                assert_eq!(
                    sorted(d.finish().unwrap().proto),
                    expected,
                    "{name}, chunks of {chunk}"
                );
            }
        }
    }

    #[test]
    fn truncated_and_garbage_files_are_errors() {
        let bytes = fixture("gpt2/model.onnx");
        // (A cut between two fields of the model, after byte 2 for one, is a valid protobuf.)
        for cut in [1, 100, bytes.len() / 2, bytes.len() - 1] {
            let mut d = StreamDecoder::new("model.onnx");
            d.large = 1024;
            let e = d.feed(&bytes[..cut]).and_then(|_| d.finish().map(|_| ()));
            let e = e.expect_err("a truncated file").to_string();
            assert!(
                e.contains("model.onnx is not a valid ONNX file"),
                "{cut}: {e}"
            );
        }
        let e = decode_bare(b"{\"not\": \"onnx\"}", "x.onnx")
            .unwrap_err()
            .to_string();
        assert!(e.contains("x.onnx is not a valid ONNX file"), "{e}");
        let e = decode_bare(b"", "x.onnx").unwrap_err().to_string();
        assert!(e.contains("x.onnx is empty"), "{e}");
    }
}
