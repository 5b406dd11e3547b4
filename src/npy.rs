//! A reader for NumPy `.npy` arrays (format versions 1 to 3): little-endian `f4`, `i8`, `u1`
//! and `b1` in C order, the types the vision-language golden files and image arrays use.

use crate::error::{Error, Result};

/// The values of an array, by element type.
#[derive(Debug, Clone, PartialEq)]
pub enum NpyData {
    F32(Vec<f32>),
    I64(Vec<i64>),
    U8(Vec<u8>),
    Bool(Vec<bool>),
}

/// An array read from a `.npy` file.
#[derive(Debug, Clone, PartialEq)]
pub struct NpyArray {
    pub shape: Vec<usize>,
    pub data: NpyData,
}

impl NpyArray {
    /// Parse the bytes of a `.npy` file; `name` is used in error messages.
    pub fn parse(bytes: &[u8], name: &str) -> Result<NpyArray> {
        let bad = |why: String| {
            Error::InvalidInput(format!("{name} is not a supported .npy file: {why}"))
        };
        if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
            return Err(bad("no NUMPY magic".into()));
        }
        let (header_len, start) = match bytes[6] {
            1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
            2 | 3 if bytes.len() >= 12 => (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            ),
            v => return Err(bad(format!("format version {v}"))),
        };
        let header = bytes
            .get(start..start + header_len)
            .ok_or_else(|| bad("truncated header".into()))?;
        let header = std::str::from_utf8(header).map_err(|_| bad("header is not text".into()))?;
        let descr = dict_value(header, "descr").ok_or_else(|| bad("no descr".into()))?;
        let descr = descr.trim_matches(|c| c == '\'' || c == '"');
        let fortran =
            dict_value(header, "fortran_order").ok_or_else(|| bad("no fortran_order".into()))?;
        if fortran.trim() != "False" {
            return Err(bad("Fortran order (only C order is read)".into()));
        }
        let shape_text = dict_value(header, "shape").ok_or_else(|| bad("no shape".into()))?;
        let shape = shape_text
            .trim_matches(|c| c == '(' || c == ')')
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<usize>()
                    .map_err(|_| bad(format!("shape {shape_text}")))
            })
            .collect::<Result<Vec<usize>>>()?;
        let count: usize = shape.iter().product();
        let body = &bytes[start + header_len..];
        let take = |size: usize| -> Result<&[u8]> {
            body.get(..count * size).ok_or_else(|| {
                bad(format!(
                    "{} data bytes for {count} elements of {size} bytes",
                    body.len()
                ))
            })
        };
        let data = match descr {
            "<f4" => NpyData::F32(
                take(4)?
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            "<i8" => NpyData::I64(
                take(8)?
                    .chunks_exact(8)
                    .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                    .collect(),
            ),
            "|u1" => NpyData::U8(take(1)?.to_vec()),
            "|b1" => NpyData::Bool(take(1)?.iter().map(|&b| b != 0).collect()),
            d => return Err(bad(format!("element type {d} (read: <f4, <i8, |u1, |b1)"))),
        };
        Ok(NpyArray { shape, data })
    }

    /// The values as f32 (an error for other element types).
    pub fn into_f32(self, name: &str) -> Result<Vec<f32>> {
        match self.data {
            NpyData::F32(v) => Ok(v),
            _ => Err(Error::InvalidInput(format!(
                "{name}: expected a float32 array"
            ))),
        }
    }
}

/// The text after `'key':` in a Python dict literal, up to the next top-level comma.
fn dict_value<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let at = header
        .find(&format!("'{key}'"))
        .or_else(|| header.find(&format!("\"{key}\"")))?;
    let rest = &header[at + key.len() + 2..];
    let rest = rest[rest.find(':')? + 1..].trim_start();
    let mut depth = 0;
    for (i, c) in rest.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&rest[..=i]);
                }
            }
            ',' | '}' if depth == 0 => return Some(rest[..i].trim()),
            _ => {}
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn npy(descr: &str, shape: &str, body: &[u8]) -> Vec<u8> {
        let mut header =
            format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend((header.len() as u16).to_le_bytes());
        out.extend(header.as_bytes());
        out.extend(body);
        out
    }

    #[test]
    fn reads_the_element_types() {
        let f: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let a = NpyArray::parse(&npy("<f4", "(2,)", &f), "f").unwrap();
        assert_eq!((a.shape, a.data), (vec![2], NpyData::F32(vec![1.5, -2.0])));
        let i: Vec<u8> = [3i64, -4, 5, 6]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let a = NpyArray::parse(&npy("<i8", "(2, 2)", &i), "i").unwrap();
        assert_eq!(
            (a.shape, a.data),
            (vec![2, 2], NpyData::I64(vec![3, -4, 5, 6]))
        );
        let a = NpyArray::parse(&npy("|b1", "(1, 2)", &[1, 0]), "b").unwrap();
        assert_eq!(a.data, NpyData::Bool(vec![true, false]));
        let a = NpyArray::parse(&npy("|u1", "(0, 64)", &[]), "u").unwrap();
        assert_eq!((a.shape, a.data), (vec![0, 64], NpyData::U8(vec![])));
    }

    #[test]
    fn refuses_what_it_cannot_read() {
        assert!(NpyArray::parse(b"not numpy", "x").is_err());
        assert!(NpyArray::parse(&npy("<f8", "(1,)", &[0; 8]), "x").is_err());
        assert!(NpyArray::parse(&npy("<f4", "(3,)", &[0; 8]), "x").is_err());
        let fortran = npy("<f4", "(1,)", &[0; 4]);
        let text = String::from_utf8_lossy(&fortran).replace("False", "True ");
        assert!(NpyArray::parse(text.as_bytes(), "x").is_err());
    }
}
