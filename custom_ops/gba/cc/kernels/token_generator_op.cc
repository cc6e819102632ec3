// Token generator (SPEC section 1, "Tokens"): one per job, on parameter server 0. The i-th fetch
// returns token floor(i / M); tokens are never waited for, so a worker that dies loses its token.

#include "custom_ops/common/kernel_util.h"
#include "custom_ops/common/resource_util.h"

namespace tf_gba {

class TokenGenerator : public ::tensorflow::ResourceBase {
 public:
  TokenGenerator(int64_t num_aggregate, int64_t count)
      : num_aggregate_(num_aggregate), count_(count) {}

  std::string DebugString() const override {
    return ::tensorflow::strings::StrCat("GBA TokenGenerator(M=", num_aggregate_, ")");
  }

  void Fetch(int64_t* token, int64_t* ticket) TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::mutex_lock lock(mu_);
    *ticket = count_++;
    *token = *ticket / num_aggregate_;
  }
  int64_t count() const TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::tf_shared_lock lock(mu_);
    return count_;
  }
  void Reset(int64_t count) TF_LOCKS_EXCLUDED(mu_) {
    ::tensorflow::mutex_lock lock(mu_);
    count_ = count;
  }
  int64_t num_aggregate() const { return num_aggregate_; }

 private:
  const int64_t num_aggregate_;
  mutable ::tensorflow::mutex mu_;
  int64_t count_ TF_GUARDED_BY(mu_);
};

class TokenGeneratorCreateOp : public OpKernel {
 public:
  explicit TokenGeneratorCreateOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("num_aggregate", &num_aggregate_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("initial_count", &initial_count_));
    OP_REQUIRES_OK(ctx, name_.FromAttrs(ctx));
    OP_REQUIRES(ctx, num_aggregate_ >= 1,
                errors::InvalidArgument("num_aggregate (M) must be >= 1, got ", num_aggregate_,
                                        "."));
    OP_REQUIRES(ctx, initial_count_ >= 0,
                errors::InvalidArgument("initial_count must be >= 0, got ", initial_count_, "."));
  }
  void Compute(OpKernelContext* ctx) override {
    CreateResourceAndOutputHandle<TokenGenerator>(
        ctx, name_, [this](TokenGenerator** out) {
          *out = new TokenGenerator(num_aggregate_, initial_count_);
          return ::tensorflow::OkStatus();
        });
  }

 private:
  int64_t num_aggregate_, initial_count_;
  ResourceName name_;
};

class TokenGeneratorFetchOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<TokenGenerator> gen;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &gen));
    int64_t token, ticket;
    gen->Fetch(&token, &ticket);
    Tensor *t0, *t1;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &t0));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &t1));
    t0->scalar<int64_t>()() = token;
    t1->scalar<int64_t>()() = ticket;
  }
};

class TokenGeneratorCountOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<TokenGenerator> gen;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &gen));
    Tensor *t0, *t1;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, TensorShape({}), &t0));
    OP_REQUIRES_OK(ctx, ctx->allocate_output(1, TensorShape({}), &t1));
    t0->scalar<int64_t>()() = gen->count();
    t1->scalar<int64_t>()() = gen->num_aggregate();
  }
};

class TokenGeneratorResetOp : public OpKernel {
 public:
  using OpKernel::OpKernel;
  void Compute(OpKernelContext* ctx) override {
    ::tensorflow::core::RefCountPtr<TokenGenerator> gen;
    OP_REQUIRES_OK(ctx, LookupResource(ctx, HandleFromInput(ctx, 0), &gen));
    int64_t count;
    OP_REQUIRES_OK(ctx, ReadScalarInt64(ctx, 1, "count", &count));
    OP_REQUIRES(ctx, count >= 0,
                errors::InvalidArgument("Token count must be >= 0, got ", count, "."));
    gen->Reset(count);
  }
};

REGISTER_KERNEL_BUILDER(Name("GBA>TokenGeneratorCreate").Device(::tensorflow::DEVICE_CPU),
                        TokenGeneratorCreateOp);
REGISTER_KERNEL_BUILDER(Name("GBA>TokenGeneratorFetch").Device(::tensorflow::DEVICE_CPU),
                        TokenGeneratorFetchOp);
REGISTER_KERNEL_BUILDER(Name("GBA>TokenGeneratorCount").Device(::tensorflow::DEVICE_CPU),
                        TokenGeneratorCountOp);
REGISTER_KERNEL_BUILDER(Name("GBA>TokenGeneratorReset").Device(::tensorflow::DEVICE_CPU),
                        TokenGeneratorResetOp);

}  // namespace tf_gba
