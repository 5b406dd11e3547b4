//! A malformed model is an error, never a panic (a panic in wasm kills the instance): the
//! fixtures' graphs altered one edit at a time (an attribute, an initializer's shape, type or
//! data, a node's inputs or outputs, a node removed, a graph input's type or shape), and their
//! `config.json`, `generation_config.json` and `tokenizer.json` (a value replaced by an odd one,
//! or removed), each loaded and, where it loads, asked for three greedy tokens. Deterministic
//! edits from fixed seeds, 1,500 a graph and 300 a model's JSON files (`MUTATED_EDITS=n` for
//! more).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;

use onnx_generate::{Model, ModelFiles};
use serde_json::{json, Map, Value};
use tract_onnx::pb;

/// xorshift64: a deterministic stream of edits.
struct Stream(u64);

impl Stream {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// An integer near `v` or at an edge: what a mistaken exporter writes.
fn odd_int(s: &mut Stream, v: i64) -> i64 {
    match s.below(9) {
        0 => 0,
        1 => -1,
        2 => v + 1,
        3 => v - 1,
        4 => v * 2,
        5 => -v,
        6 => 1 << 40,
        7 => i64::MIN,
        _ => v / 2,
    }
}

/// One edit of `graph`, described.
fn edit(graph: &mut pb::GraphProto, s: &mut Stream) -> String {
    match s.below(7) {
        0 => {
            // An integer attribute or one of an integer list.
            let with: Vec<usize> = (0..graph.node.len())
                .filter(|&i| {
                    graph.node[i]
                        .attribute
                        .iter()
                        .any(|a| a.r#type == 2 || a.r#type == 7)
                })
                .collect();
            if with.is_empty() {
                return "nothing".into();
            }
            let node = &mut graph.node[with[s.below(with.len())]];
            let ints: Vec<usize> = (0..node.attribute.len())
                .filter(|&i| node.attribute[i].r#type == 2 || node.attribute[i].r#type == 7)
                .collect();
            let a = &mut node.attribute[ints[s.below(ints.len())]];
            if a.r#type == 2 {
                let v = odd_int(s, a.i);
                a.i = v;
                format!("{} '{}': {} = {v}", node.op_type, node.name, a.name)
            } else if a.ints.is_empty() {
                a.ints.push(odd_int(s, 1));
                format!("{} '{}': {} gets a value", node.op_type, node.name, a.name)
            } else {
                let i = s.below(a.ints.len());
                match s.below(3) {
                    0 => {
                        a.ints.remove(i);
                    }
                    1 => a.ints.push(a.ints[i]),
                    _ => a.ints[i] = odd_int(s, a.ints[i]),
                }
                format!(
                    "{} '{}': {} = {:?}",
                    node.op_type, node.name, a.name, a.ints
                )
            }
        }
        1 => {
            // An initializer's or a Constant's shape.
            let Some(t) = some_tensor(graph, s) else {
                return "nothing".into();
            };
            if t.dims.is_empty() || s.below(4) == 0 {
                t.dims.push(odd_int(s, 1).clamp(-1, 4));
            } else {
                let i = s.below(t.dims.len());
                match s.below(3) {
                    0 => {
                        t.dims.remove(i);
                    }
                    _ => t.dims[i] = odd_int(s, t.dims[i]),
                }
            }
            format!("tensor '{}': dims {:?}", t.name, t.dims)
        }
        2 => {
            // An initializer's element type or data.
            let Some(t) = some_tensor(graph, s) else {
                return "nothing".into();
            };
            match s.below(3) {
                0 => {
                    t.data_type = [1, 2, 3, 6, 7, 9, 10, 11, 16, 0, 99][s.below(11)];
                    format!("tensor '{}': type {}", t.name, t.data_type)
                }
                1 => {
                    let keep = s.below(t.raw_data.len() + 1);
                    t.raw_data.truncate(keep);
                    t.int64_data.truncate(s.below(t.int64_data.len() + 1));
                    t.float_data.truncate(s.below(t.float_data.len() + 1));
                    format!("tensor '{}': data cut", t.name)
                }
                _ => {
                    for b in t.raw_data.iter_mut() {
                        *b = 0xff;
                    }
                    for v in t.int64_data.iter_mut() {
                        *v = -1;
                    }
                    format!("tensor '{}': every byte 0xff", t.name)
                }
            }
        }
        3 => {
            // A node's input: another tensor, none, or one more.
            let names: Vec<String> = graph
                .node
                .iter()
                .flat_map(|n| n.output.iter().cloned())
                .chain(graph.initializer.iter().map(|t| t.name.clone()))
                .chain(graph.input.iter().map(|i| i.name.clone()))
                .collect();
            let at = s.below(graph.node.len());
            let node = &mut graph.node[at];
            let other = names[s.below(names.len())].clone();
            match s.below(4) {
                0 if !node.input.is_empty() => {
                    node.input.pop();
                }
                1 => node.input.push(other),
                2 if !node.input.is_empty() => {
                    let i = s.below(node.input.len());
                    node.input[i] = String::new();
                }
                _ if !node.input.is_empty() => {
                    let i = s.below(node.input.len());
                    node.input[i] = other;
                }
                _ => node.input.push(other),
            }
            format!("{} '{}': inputs {:?}", node.op_type, node.name, node.input)
        }
        4 => {
            // A node removed (its outputs then come from nowhere).
            let node = graph.node.remove(s.below(graph.node.len()));
            format!("{} '{}' removed", node.op_type, node.name)
        }
        5 => {
            // A node's outputs: one fewer or one more.
            let at = s.below(graph.node.len());
            let node = &mut graph.node[at];
            if node.output.len() > 1 && s.below(2) == 0 {
                node.output.pop();
            } else {
                node.output.push(format!("{}_extra", node.name));
            }
            format!(
                "{} '{}': outputs {:?}",
                node.op_type, node.name, node.output
            )
        }
        _ => {
            // A graph input's element type or a dimension of its shape.
            use pb::tensor_shape_proto::dimension::Value as Dim;
            use pb::type_proto::Value as Type;
            let at = s.below(graph.input.len());
            let input = &mut graph.input[at];
            let Some(Type::TensorType(t)) = input.r#type.as_mut().and_then(|t| t.value.as_mut())
            else {
                return "nothing".into();
            };
            if s.below(2) == 0 {
                t.elem_type = [1, 6, 7, 10, 11, 0][s.below(6)];
                format!("input '{}': type {}", input.name, t.elem_type)
            } else if let Some(shape) = t.shape.as_mut() {
                if shape.dim.is_empty() {
                    return "nothing".into();
                }
                let i = s.below(shape.dim.len());
                match s.below(3) {
                    0 => {
                        shape.dim.remove(i);
                    }
                    1 => shape.dim[i].value = Some(Dim::DimValue(odd_int(s, 2).clamp(0, 64))),
                    _ => shape.dim[i].value = Some(Dim::DimParam("odd".into())),
                }
                format!("input '{}': {} dims", input.name, shape.dim.len())
            } else {
                "nothing".into()
            }
        }
    }
}

/// An initializer or a `Constant`'s value.
fn some_tensor<'a>(
    graph: &'a mut pb::GraphProto,
    s: &mut Stream,
) -> Option<&'a mut pb::TensorProto> {
    let constants: Vec<usize> = (0..graph.node.len())
        .filter(|&i| graph.node[i].op_type == "Constant")
        .collect();
    let total = graph.initializer.len() + constants.len();
    if total == 0 {
        return None;
    }
    let pick = s.below(total);
    if pick < graph.initializer.len() {
        return graph.initializer.get_mut(pick);
    }
    let node = &mut graph.node[constants[pick - graph.initializer.len()]];
    node.attribute.iter_mut().find_map(|a| a.t.as_mut())
}

fn fixture(name: &str) -> ModelFiles {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/models")
        .join(name);
    ModelFiles::from_dir(&dir, None).unwrap()
}

/// Panics in tract on altered graphs that its type and shape inference lets through, at the
/// versions of `Cargo.lock` (README, "Malformed models"): ranks, axes and constant values that
/// do not fit the tensors they meet. Found by 25,000 edits of each fixture; any other panic
/// fails the test.
const TRACT_PANICS: [(&str, u32); 12] = [
    // A constant `Gather` index beyond its axis; a `Gather` of data of another rank.
    ("tract-core-0.23.9/src/ops/array/gather.rs", 75),
    ("tract-core-0.23.9/src/ops/array/gather.rs", 85),
    ("tract-core-0.23.9/src/ops/array/gather_nd.rs", 28),
    ("tract-core-0.23.9/src/ops/array/gather_nd.rs", 72),
    // A `Pow` of types with no common supertype.
    ("tract-onnx-0.23.9/src/ops/math/pow.rs", 58),
    // Reduction, `Flatten`, `Squeeze` and `Unsqueeze` axes beyond the rank.
    ("tract-hir-0.23.9/src/ops/nn/reduce.rs", 124),
    ("tract-hir-0.23.9/src/ops/array/flatten.rs", 15),
    ("smallvec-1.16.6/src/lib.rs", 1513),
    ("smallvec-1.16.6/src/lib.rs", 1538),
    // A shape computed as negative; a `Slice` step of zero or a shift past 64 bits.
    ("tract-core-0.23.9/src/model/fact.rs", 21),
    ("tract-core-0.23.9/src/ops/array/strided_slice.rs", 25),
    ("tract-hir-0.23.9/src/ops/array/strided_slice.rs", 44),
];

thread_local! {
    /// Inside `run`: where this thread's last panic happened.
    static PANICKED_AT: std::cell::RefCell<Option<Option<(String, u32)>>> =
        const { std::cell::RefCell::new(None) };
}

/// Loads `files` and asks for three greedy tokens: whether it loaded, or a panic's place and
/// message.
fn run(files: &ModelFiles) -> Result<bool, ((String, u32), String)> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let at = info.location().map(|l| (l.file().to_string(), l.line()));
            let caught = PANICKED_AT.with(|p| match p.borrow_mut().as_mut() {
                Some(slot) => {
                    *slot = at;
                    true
                }
                None => false,
            });
            if !caught {
                default(info);
            }
        }))
    });
    PANICKED_AT.with(|p| *p.borrow_mut() = Some(None));
    let result = catch_unwind(AssertUnwindSafe(|| {
        let Ok(model) = Model::load(files) else {
            return false;
        };
        let options: Map<String, Value> =
            json!({"max_new_tokens": 3}).as_object().cloned().unwrap();
        let _ = model.generate(&[vec![1, 5, 9]], &options, |_| {});
        true
    }))
    .map_err(|p| {
        let message = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        let at = PANICKED_AT.with(|p| p.borrow().clone().flatten());
        (at.unwrap_or_default(), message)
    });
    PANICKED_AT.with(|p| *p.borrow_mut() = None);
    result
}

fn no_panics(name: &str, seed: u64, edits: usize) {
    let files = fixture(name);
    let proto = <pb::ModelProto as prost::Message>::decode(&files.model[..]).unwrap();
    let mut s = Stream(seed);
    let (mut panics, mut tract, mut loaded) = (vec![], 0, 0);
    let edits = std::env::var("MUTATED_EDITS").map_or(edits, |n| n.parse().unwrap());
    for i in 0..edits {
        let mut p = proto.clone();
        let what = edit(p.graph.as_mut().unwrap(), &mut s);
        let mut f = files.clone();
        f.model = prost::Message::encode_to_vec(&p);
        match run(&f) {
            Ok(l) => loaded += l as usize,
            Err(((file, line), _))
                if TRACT_PANICS
                    .iter()
                    .any(|&(f, l)| file.ends_with(f) && line == l) =>
            {
                tract += 1
            }
            Err(((file, line), message)) => panics.push(format!(
                "{name} edit {i} ({what}): {file}:{line}: {message}"
            )),
        }
    }
    eprintln!("{name}: {edits} edits, {loaded} graphs loaded, {tract} panicked in tract as listed");
    assert!(
        panics.is_empty(),
        "{} panics:\n{}",
        panics.len(),
        panics.join("\n")
    );
    // Edits that keep the graph loadable exercise generation too.
    assert!(
        loaded * 10 > edits,
        "{loaded} of {edits} altered graphs loaded"
    );
}

#[test]
fn altered_llama_never_panics() {
    no_panics("llama", 0x9e37_79b9_7f4a_7c15, 1500);
}

#[test]
fn altered_genai_llama_never_panics() {
    no_panics("llama-genai", 0xd1b5_4a32_d192_ed03, 1500);
}

#[test]
fn altered_gpt2_never_panics() {
    no_panics("gpt2", 0x8cb9_2ba7_2f3d_8dd7, 1500);
}

/// Found by the edits above: a weight's product (`MatMulWeights`) of a scalar `A` panicked on
/// its rank less one.
#[test]
fn a_scalar_times_a_weight_is_an_error() {
    let mut files = fixture("llama-genai");
    let mut proto = <pb::ModelProto as prost::Message>::decode(&files.model[..]).unwrap();
    let graph = proto.graph.as_mut().unwrap();
    let node = graph
        .node
        .iter_mut()
        .find(|n| n.name == "/model/layers.0/attn/o_proj/MatMul")
        .unwrap();
    // The total sequence length: a scalar.
    node.input[0] = "/model/attn_mask_reformat/attn_mask_subgraph/Gather/output_0".into();
    files.model = prost::Message::encode_to_vec(&proto);
    let Err(e) = Model::load(&files) else {
        panic!("a scalar times a weight loaded");
    };
    let e = e.to_string();
    assert!(
        e.contains("A is a scalar; expected its last axis to be K"),
        "{e}"
    );
}

/// Every place in `v` (JSON pointers), the root included.
fn pointers(v: &Value, at: String, into: &mut Vec<String>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                pointers(
                    x,
                    format!("{at}/{}", k.replace('~', "~0").replace('/', "~1")),
                    into,
                );
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                pointers(x, format!("{at}/{i}"), into);
            }
        }
        _ => {}
    }
    into.push(at);
}

/// One edit of a JSON file: a value replaced by an odd one, or removed.
fn edit_json(v: &mut Value, s: &mut Stream) -> String {
    let odd = [
        json!(0),
        json!(-1),
        json!(1),
        json!(2),
        json!(7),
        json!(1e9),
        json!(4294967296u64),
        json!(1.5),
        json!(-0.5),
        json!(1e300),
        json!(null),
        json!(true),
        json!("x"),
        json!(""),
        json!([]),
        json!({}),
        json!([1, 2]),
        json!([-1]),
    ];
    let mut all = vec![];
    pointers(v, String::new(), &mut all);
    let at = all[s.below(all.len())].clone();
    if s.below(4) == 0 && !at.is_empty() {
        let (parent, key) = at.rsplit_once('/').unwrap();
        match v.pointer_mut(parent) {
            Some(Value::Object(m)) => {
                m.remove(&key.replace("~1", "/").replace("~0", "~"));
            }
            Some(Value::Array(a)) => {
                a.remove(key.parse::<usize>().unwrap());
            }
            _ => {}
        }
        return format!("{at} removed");
    }
    let new = odd[s.below(odd.len())].clone();
    let described = format!("{at} = {new}");
    *v.pointer_mut(&at).unwrap() = new;
    described
}

/// `config.json`, `generation_config.json` and `tokenizer.json` of the fixture `name`, one
/// edit at a time: none may panic (tract's inference is not involved: the graph is intact, so
/// no panic is allowed at all).
fn no_panics_in_json(name: &str, seed: u64, edits: usize) {
    let files = fixture(name);
    let mut s = Stream(seed);
    let (mut panics, mut loaded) = (vec![], 0);
    let edits = std::env::var("MUTATED_EDITS").map_or(edits, |n| n.parse().unwrap());
    for i in 0..edits {
        let mut f = files.clone();
        let (file_name, bytes) = match s.below(5) {
            0 | 1 => ("config.json", &mut f.config),
            2 | 3 => match f.generation_config.as_mut() {
                Some(g) => ("generation_config.json", g),
                None => ("config.json", &mut f.config),
            },
            _ => ("tokenizer.json", &mut f.tokenizer),
        };
        let mut v: Value = serde_json::from_slice(bytes).unwrap();
        let what = edit_json(&mut v, &mut s);
        *bytes = serde_json::to_vec(&v).unwrap();
        match run(&f) {
            Ok(l) => loaded += l as usize,
            Err(((file, line), message)) => panics.push(format!(
                "{name} edit {i} ({file_name}: {what}): {file}:{line}: {message}"
            )),
        }
    }
    eprintln!("{name}: {edits} edits of its JSON files, {loaded} models loaded");
    assert!(
        loaded * 10 > edits,
        "{loaded} of {edits} altered models loaded"
    );
    assert!(
        panics.is_empty(),
        "{} panics:\n{}",
        panics.len(),
        panics.join("\n")
    );
}

#[test]
fn altered_json_files_never_panic() {
    no_panics_in_json("llama", 0x6a09_e667_f3bc_c908, 300);
    no_panics_in_json("llama-genai", 0xbb67_ae85_84ca_a73b, 300);
    no_panics_in_json("gpt2", 0x3c6e_f372_fe94_f82b, 300);
}
