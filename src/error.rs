//! The one error type of the crate. Every public function returns `Result<T>`; nothing panics
//! on bad input (a panic in wasm kills the instance and the loaded model with it).

use std::fmt;

/// What went wrong, with a message that names the bad input and what was expected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// A generation option or an input of a request is invalid (name it in the message).
    InvalidInput(String),
    /// A model file is missing, unreadable or not what the engine can run.
    Model(String),
    /// The tokenizer could not encode or decode.
    Tokenizer(String),
    /// The backend failed while running a step.
    Backend(String),
    /// A feature the request asks for is not supported by this engine or this model.
    Unsupported(String),
}

pub type Result<T> = std::result::Result<T, Error>;

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidInput(m) => write!(f, "invalid input: {m}"),
            Error::Model(m) => write!(f, "model: {m}"),
            Error::Tokenizer(m) => write!(f, "tokenizer: {m}"),
            Error::Backend(m) => write!(f, "backend: {m}"),
            Error::Unsupported(m) => write!(f, "unsupported: {m}"),
        }
    }
}

impl std::error::Error for Error {}

/// Shorthand for `Err(Error::InvalidInput(format!(...)))`.
macro_rules! invalid {
    ($($arg:tt)*) => { Err($crate::error::Error::InvalidInput(format!($($arg)*))) };
}
pub(crate) use invalid;

/// A model error's message prefixed with the file it is about (`map_err(in_file(name))`).
pub(crate) fn in_file(file: &str) -> impl Fn(Error) -> Error + '_ {
    move |e| match e {
        Error::Model(m) => Error::Model(format!("{file}: {m}")),
        e => e,
    }
}

/// Render a tract error with its whole context chain (tract errors are `anyhow` errors).
pub(crate) fn backend(e: impl fmt::Debug) -> Error {
    Error::Backend(format!("{e:?}"))
}
