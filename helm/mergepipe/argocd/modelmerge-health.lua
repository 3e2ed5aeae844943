-- Argo CD health check for mergepipe.io/ModelMerge.
-- Healthy: Ready=True (the snapshot is committed and verified) for the current generation.
-- Degraded: Ready=False with a reason that needs a change (InvalidSpec, JobFailed, QuotaExceeded).
-- Progressing: anything else (not yet observed, planning, analyzing, Job running).
local hs = {}
local generation = nil
if obj.metadata ~= nil then
  generation = obj.metadata.generation
end
if obj.status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the mergepipe operator"
  return hs
end
if generation ~= nil and (obj.status.observedGeneration == nil or obj.status.observedGeneration < generation) then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  return hs
end
local ready = nil
if obj.status.conditions ~= nil then
  for _, c in ipairs(obj.status.conditions) do
    if c.type == "Ready" then
      ready = c
    end
  end
end
if ready == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the Ready condition"
  return hs
end
if generation ~= nil and ready.observedGeneration ~= nil and ready.observedGeneration < generation then
  hs.status = "Progressing"
  hs.message = "Ready condition is from an older generation"
  return hs
end
local reason = ready.reason or ""
local message = ready.message or ""
if ready.status == "True" then
  hs.status = "Healthy"
  hs.message = message
  return hs
end
local terminal = { InvalidSpec = true, JobFailed = true, QuotaExceeded = true }
if ready.status == "False" and terminal[reason] then
  hs.status = "Degraded"
else
  hs.status = "Progressing"
end
hs.message = reason .. ": " .. message
return hs
