// LAPROX_RETURN_IF_ERROR / LAPROX_ASSIGN_OR_RETURN: early return on a non-OK absl::Status.
#ifndef LAPROX_KERNELS_COMMON_STATUS_MACROS_H_
#define LAPROX_KERNELS_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

// NOLINTBEGIN(bugprone-macro-parentheses): `lhs` is a declaration, not an expression.
#define LAPROX_STATUS_CONCAT_INNER_(a, b) a##b
#define LAPROX_STATUS_CONCAT_(a, b) LAPROX_STATUS_CONCAT_INNER_(a, b)

// Evaluates `expr` (an absl::Status) once and returns it from the enclosing function if not OK.
#define LAPROX_RETURN_IF_ERROR(expr) \
  LAPROX_RETURN_IF_ERROR_IMPL_(LAPROX_STATUS_CONCAT_(laprox_status_, __COUNTER__), expr)

#define LAPROX_RETURN_IF_ERROR_IMPL_(status, expr) \
  do {                                             \
    ::absl::Status status = (expr);                \
    if (!status.ok()) return status;               \
  } while (false)

// `lhs` = value of `rexpr` (an absl::StatusOr<T>), or returns its status from the function.
#define LAPROX_ASSIGN_OR_RETURN(lhs, rexpr) \
  LAPROX_ASSIGN_OR_RETURN_IMPL_(LAPROX_STATUS_CONCAT_(laprox_statusor_, __COUNTER__), lhs, rexpr)

#define LAPROX_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, rexpr) \
  auto statusor = (rexpr);                                  \
  if (!statusor.ok()) return std::move(statusor).status();  \
  lhs = std::move(statusor).value()

// NOLINTEND(bugprone-macro-parentheses)

#endif  // LAPROX_KERNELS_COMMON_STATUS_MACROS_H_
